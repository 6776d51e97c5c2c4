"""Datasets outlive their strategy: after ``experimental_finalize()`` every use of one is the
strategy's "finalized" ``ContextError`` on every rank, never an MPI error about a freed
communicator, and never local data as if nothing happened (with the check on or off)."""

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat
from mpistrat import CommunicationOptions, ContextError

FINALIZED = "this strategy was finalized"


@pytest.mark.parametrize("check", [False, True])
def test_iterating_after_finalize_is_the_finalized_error(check):
    strategy = mpistrat.MPIStrategy(communication_options=CommunicationOptions(check=check))
    global_batches = [np.arange(4.0 * strategy.num_replicas_in_sync)] * 3
    split = strategy.experimental_distribute_dataset(global_batches)
    iterator = iter(split)
    expected = np.split(global_batches[0], strategy.num_replicas_in_sync)[MPI.COMM_WORLD.Get_rank()]
    np.testing.assert_array_equal(next(iterator), expected)  # it worked before the finalize
    untouched = strategy.experimental_distribute_dataset(global_batches)
    strategy.experimental_finalize()
    uses = {
        "next on an open iterator": lambda: next(iterator),
        "a dataset made before": lambda: next(iter(untouched)),
        "a dataset made after": lambda: next(iter(strategy.experimental_distribute_dataset(global_batches))),
        "per-replica pipelines": lambda: strategy.distribute_datasets_from_function(lambda ctx: [np.ones(2)]),
    }
    for name, use in uses.items():
        with pytest.raises(ContextError, match=FINALIZED):
            use()
            pytest.fail(f"{name}: no error")
