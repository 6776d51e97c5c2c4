"""The public functions of ``mpistrat.input`` take a strategy, as they always did, or its
``Collectives``, and give what the strategy's own methods give. The reference is NumPy: each
replica's rows of a global batch are its contiguous share, as tf splits it (rank r of R)."""

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat
from mpistrat.input import contexts, datasets

WORLD = MPI.COMM_WORLD


@pytest.fixture
def strategy():
    s = mpistrat.MPIStrategy()
    yield s
    s.experimental_finalize()


@pytest.mark.parametrize("handed", ["strategy", "collectives"])
def test_each_function_gives_this_replicas_share(strategy, handed):
    ranks, rank = WORLD.Get_size(), WORLD.Get_rank()
    given = strategy if handed == "strategy" else strategy.extended.collectives
    batch = np.arange(4.0 * ranks)
    mine = np.split(batch, ranks)[rank]
    with strategy.scope():
        np.testing.assert_array_equal(next(iter(datasets.distribute_dataset(given, [batch]))), mine)
        it = datasets.make_dataset_iterator(given, [batch])
        it.initialize()
        np.testing.assert_array_equal(it.get_next(), mine)
        own = datasets.distribute_datasets_from_function(
            given, lambda ctx: [np.full(2, ctx.input_pipeline_id)]
        )
        np.testing.assert_array_equal(next(iter(own)), np.full(2, rank))
        it = datasets.make_input_fn_iterator(given, lambda ctx: [np.full(3, ctx.input_pipeline_id)])
        it.initialize()
        np.testing.assert_array_equal(it.get_next(), np.full(3, rank))
        assert (
            contexts.distribute_values_from_function(given, lambda c: 10 * c.replica_id_in_sync_group)
            == 10 * rank
        )
