"""Bad input that used to escape the handshake: unaligned arrays and nests too deep to walk.

Unaligned (but contiguous) arrays are accepted and give serial NumPy's result; a nest deeper
than optree will walk raises InvalidArgumentError on every rank, even when one rank alone
passed it. Run at 1-3 ranks.
"""

import tracemalloc

import numpy as np
import optree
import pytest

from mpistrat import InvalidArgumentError
from mpistrat.collectives import Collectives, mismatch
from tests.conftest import all_ranks_agree, raises_on_every_rank


def unaligned(values: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``values`` one byte off its dtype's alignment."""
    raw = bytearray(values.nbytes + 1)
    arr = np.frombuffer(raw, dtype=values.dtype, offset=1).reshape(values.shape)
    arr[...] = values  # frombuffer of a bytearray is writable
    assert not arr.flags.aligned and arr.flags.c_contiguous
    return arr


def rank_values(rank: int, dtype: str, shape=(3, 4)) -> np.ndarray:
    return (np.arange(np.prod(shape)).reshape(shape) + 10 * rank).astype(dtype)


@pytest.fixture(scope="module")
def coll(world):
    return Collectives(world.comm.Dup())


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("who", ["every rank", "rank 0 only"])
def test_unaligned_arrays_are_accepted(world, coll, dtype, who):
    size, rank = world.size, world.rank
    mine = rank_values(rank, dtype)
    arg = unaligned(mine) if who == "every rank" or rank == 0 else mine
    every = [rank_values(r, dtype) for r in range(size)]
    results = {
        "all_reduce one array": (coll.all_reduce("sum", arg), np.sum(every, axis=0)),
        "all_reduce nest": (coll.all_reduce("sum", [arg, arg])[1], np.sum(every, axis=0)),
        "all_gather axis 0": (coll.all_gather([arg], axis=0)[0], np.concatenate(every, axis=0)),
        "all_gather axis 1": (coll.all_gather([arg, mine], axis=1)[0], np.concatenate(every, axis=1)),
        "broadcast": (coll.broadcast([arg], root=0)[0], every[0]),
    }
    bad = [
        k for k, (got, want) in results.items() if got.dtype != want.dtype or not np.array_equal(got, want)
    ]
    all_ranks_agree(world.comm, not bad, f"differ from NumPy: {bad}")


# optree refuses to walk deeper than this (a RecursionError), whatever sys.getrecursionlimit() says.
MAX_DEPTH = getattr(optree, "MAX_RECURSION_DEPTH", 1000)


def deep(depth: int) -> object:
    value: object = np.ones(2)
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("who", ["every rank", "rank 0 only"])
@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "broadcast"])
def test_too_deep_a_nest_raises_on_every_rank(world, coll, collective, who):
    value = deep(MAX_DEPTH + 50) if who == "every rank" or world.rank == 0 else deep(3)
    call = {
        "all_reduce": lambda: coll.all_reduce("sum", value),
        "all_gather": lambda: coll.all_gather(value, axis=0),
        "broadcast": lambda: coll.broadcast(value, root=0),
    }[collective]
    message = raises_on_every_rank(world.comm, InvalidArgumentError, call, match="too deep")
    assert str(MAX_DEPTH) in message
    assert coll.all_reduce("sum", np.ones(2))[0] == world.size  # still in step afterwards


def test_describe_never_raises_on_a_deep_nest():
    described = mismatch.describe(deep(MAX_DEPTH + 50), None)
    assert f"deeper than {MAX_DEPTH}" in described["structure"]
    assert mismatch.first_difference([described, mismatch.describe(deep(2), None)])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("leaves", "axis"), [(1, 0), (4, 0), (1, 1), (4, 1)])
def test_all_gather_allocates_the_result_and_at_most_one_input(world, coll, dtype, leaves, axis):
    """NumPy reports its allocations to tracemalloc: the peak is counted, not timed."""
    size, rank = world.size, world.rank
    shape = (64, 4096) if axis == 0 else (4096, 64)  # 1 MiB of float32 per leaf and rank
    value = [rank_values(rank, dtype, shape) + k for k in range(leaves)]
    in_bytes = sum(a.nbytes for a in value)
    tracemalloc.start()
    try:
        out = coll.all_gather(value, axis=axis)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    out_bytes = sum(o.nbytes for o in out)
    want = [
        np.concatenate([rank_values(r, dtype, shape) + k for r in range(size)], axis=axis)
        for k in range(leaves)
    ]
    same = all(
        o.dtype == w.dtype and o.flags.c_contiguous and np.array_equal(o, w)
        for o, w in zip(out, want, strict=True)
    )
    all_ranks_agree(world.comm, same, "differs from NumPy")
    limit = out_bytes + in_bytes + (256 << 10)
    all_ranks_agree(
        world.comm, peak <= limit, f"peak {peak} > result {out_bytes} + input {in_bytes} + 256 KiB"
    )
