"""Distributed input: datasets split across replicas, one pipeline per replica, and their iterators.

>>> import mpistrat, numpy as np
>>> strategy = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
>>> dist = strategy.experimental_distribute_dataset(mpistrat.ArrayDataset(np.arange(6), batch_size=4))
>>> [strategy.run(lambda x: x.sum(), args=(x,)) for x in dist]
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
