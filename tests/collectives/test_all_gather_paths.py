"""all_gather of one plain NumPy array takes a shorter path than a nest: both give NumPy's
concatenation, and ranks on different paths (an ndarray on even ranks, an ndarray subclass on odd
ones, then the other way round) still agree, at every size the suite runs. Uneven sizes along the
axis: rank r has r + 1."""

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat
from mpistrat import CollectiveMismatchError
from tests.conftest import raises_on_every_rank

WORLD = MPI.COMM_WORLD


class Sub(np.ndarray):
    """Not exactly an ndarray: the general path."""


def block(rank: int, axis: int, dtype: str) -> np.ndarray:
    shape = [2, 3, 2]
    shape[axis] = rank + 1
    return (np.arange(np.prod(shape)).reshape(shape) + 100 * rank).astype(dtype)


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dtype", ["float32", "int64"])
@pytest.mark.parametrize("size", ["small", "direct"])  # direct: a result of 1 MiB or more
def test_one_array_on_either_path_is_numpy_concatenate(axis, dtype, size):
    strategy = mpistrat.MPIStrategy()
    rank, ranks = WORLD.Get_rank(), WORLD.Get_size()

    def mine(r: int) -> np.ndarray:
        x = block(r, axis, dtype)
        return np.tile(x, (1, 1, 20000)) if size == "direct" else x

    want = np.concatenate([mine(r) for r in range(ranks)], axis=axis)
    x = mine(rank)
    for arg in (x, x.view(Sub), [x]) if rank % 2 == 0 else (x.view(Sub), x, [x]):
        got = strategy.extended.collectives.all_gather(arg, axis)
        got = got[0] if isinstance(got, list) and isinstance(arg, list) else got
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.dtype == want.dtype


@pytest.mark.mpi(min_size=2)
def test_a_different_trailing_shape_on_one_rank_raises_on_every_rank():
    strategy = mpistrat.MPIStrategy()
    last = WORLD.Get_rank() == WORLD.Get_size() - 1
    x = np.zeros((2, 4 if last else 3), np.float32)
    gather = strategy.extended.collectives.all_gather
    raises_on_every_rank(WORLD, CollectiveMismatchError, lambda: gather(x, 0), match="all_gather")
