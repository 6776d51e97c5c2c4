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

The public names are ``mpistrat``'s (``mpistrat.ArrayDataset``, ...); this package's modules
are imported one by one, when used, so a job that distributes no dataset loads only ``contexts.py``.

>>> import numpy as np
>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> from mpistrat.input.arrays import ArrayDataset
>>> from mpistrat.input.datasets import distribute_dataset
>>> dist = distribute_dataset(Collectives(MPI.COMM_SELF.Dup()), ArrayDataset(np.arange(6), batch_size=4))
>>> [x.sum() for x in dist]
[np.int64(6), np.int64(9)]
"""
