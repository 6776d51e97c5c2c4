"""Distributed input: datasets split across replicas, one pipeline per replica, and their iterators.

Handed the ranks' :class:`~mpistrat.collectives.Collectives` (their rank, size and
collectives are all it uses):

=================  ===========================================================
``contexts.py``    ``InputContext``, ``ValueContext``, ``InputOptions``
``datasets.py``    the two distributed datasets, ``InputIterator``, checkpoint entries
``iterators.py``   ``DistributedIterator``, ``Optional``, and the split global batch's steps
``pipelines.py``   the steps of one pipeline per rank (lengths may differ)
``source.py``      the user's iterable, read from a saved position
``position.py``    where a dataset stands (epoch, batches, examples), as a checkpoint entry
``saved_row.py``   that position as a checkpoint row: the examples taken, which dataset it was
``batches.py``     checking and splitting batches; their fingerprints
``arrays.py``      ``ArrayDataset``: arrays batched, shuffled and sharded by index
=================  ===========================================================

>>> import numpy as np
>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> dist = distribute_dataset(Collectives(MPI.COMM_SELF.Dup()), ArrayDataset(np.arange(6), batch_size=4))
>>> [x.sum() for x in dist]
[np.int64(6), np.int64(9)]
"""

from mpistrat.input.arrays import ArrayDataset
from mpistrat.input.batches import ArraySpec
from mpistrat.input.contexts import (
    InputContext,
    InputOptions,
    InputReplicationMode,
    ValueContext,
    distribute_values_from_function,
)
from mpistrat.input.datasets import (
    DistributedDataset,
    DistributedDatasetsFromFunction,
    InputIterator,
    distribute_dataset,
    distribute_datasets_from_function,
    make_dataset_iterator,
    make_input_fn_iterator,
)
from mpistrat.input.iterators import DistributedIterator, Optional

__all__ = [
    "ArrayDataset",
    "ArraySpec",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "InputContext",
    "InputIterator",
    "InputOptions",
    "InputReplicationMode",
    "Optional",
    "ValueContext",
    "distribute_dataset",
    "distribute_datasets_from_function",
    "distribute_values_from_function",
    "make_dataset_iterator",
    "make_input_fn_iterator",
]
