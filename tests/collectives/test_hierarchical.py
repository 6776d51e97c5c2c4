"""``CommunicationImplementation.HIERARCHICAL`` on one node (serially and under ``mpiexec -n N``).

References: NumPy sums of every rank's input, each rebuilt from its seed on this rank. On one node
the leaders' leg is empty: nothing may be rounded to 16 bits, and nothing sent between leaders
(counted). tests/nodes/test_hierarchical_nodes.py tests the leg between nodes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import mpistrat
from mpistrat.comm.hierarchy import LEADERS, NODE
from mpistrat.errors import CollectiveMismatchError
from mpistrat.options import CommunicationImplementation, CommunicationOptions
from tests.conftest import WORLD, RankChecks, all_ranks_agree, raises_on_every_rank
from tests.support.counting import CountingComm, Ledger

HIERARCHICAL = CommunicationOptions(implementation="HIERARCHICAL")


def contribution(rank: int, dtype: str, n: int = 1001) -> np.ndarray:
    """Rank ``rank``'s input: small integers (sums exact in any dtype), rebuilt anywhere from the rank."""
    return np.random.default_rng(rank).integers(-1000, 1000, n).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_sums_equal_numpys_over_every_communicator(group, dtype, op):
    ranks = group.comm.allgather(WORLD.Get_rank())  # whose inputs this communicator sums
    mine = contribution(WORLD.Get_rank(), dtype)
    got = group.strategy.extended.collectives.all_reduce(op, {"x": mine, "y": [mine[:3]]}, HIERARCHICAL)
    total = np.sum([contribution(r, dtype).astype(np.float64) for r in ranks], axis=0)
    want = total / len(ranks) if op == "mean" else total
    dtype_out = np.float64 if op == "mean" and dtype == "int32" else mine.dtype  # tf's MEAN of ints
    checks = RankChecks()
    checks.that(got["x"].dtype == dtype_out and np.array_equal(got["x"], want.astype(dtype_out)))
    checks.that(np.array_equal(got["y"][0], got["x"][:3]))
    checks.agree(group.comm, f"{dtype} {op}: worst {np.max(np.abs(got['x'] - want))}")


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
def test_compression_rounds_nothing_on_one_node(world, codec):
    """Only the leg between nodes carries 16-bit values; one node has none, so float32 sums stay
    within float32's rounding of the exact sum (16-bit values would be off by about 2**-9)."""
    rank, size = world.rank, world.size
    parts = [np.random.default_rng(r).standard_normal(999).astype("f4") for r in range(size)]
    options = CommunicationOptions(implementation="HIERARCHICAL", compression=codec)
    got = world.strategy.extended.collectives.all_reduce("sum", parts[rank], options)
    exact = np.array([math.fsum(float(p[j]) for p in parts) for j in range(999)])
    magnitude = np.sum([np.abs(p.astype(np.float64)) for p in parts], axis=0)
    err = np.abs(got.astype(np.float64) - exact)
    ok = got.dtype == np.float32 and bool((err <= size * 2.0**-24 * magnitude).all())
    all_ranks_agree(world.comm, ok, f"worst {float(np.max(err / magnitude)):.3g} of sum|x|")


@pytest.mark.mpi(min_size=2)
def test_on_one_node_nothing_goes_between_leaders_and_each_rank_moves_the_buffer_twice(world):
    """Counted: the node's ranks reduce to the leader and get the total back (Reduce, Bcast of n
    bytes each); the leaders' communicator has one rank, and carries nothing."""
    strategy = mpistrat.MPIStrategy(CountingComm(world.comm), communication_options=HIERARCHICAL)
    x = contribution(world.rank, "float32", 4096)
    step = lambda: mpistrat.get_replica_context().all_reduce("sum", x)  # noqa: E731
    strategy.run(step)  # makes the node and leader communicators
    with Ledger.recording() as ledger:
        got = strategy.run(step)
    node = [(c.name, c.sent, c.received) for c in ledger.on(NODE).log]
    n = x.nbytes
    want = [("Reduce", 0, n), ("Bcast", n, 0)] if world.rank == 0 else [("Reduce", n, 0), ("Bcast", 0, n)]
    checks = RankChecks()
    checks.that(node == want and ledger.on(LEADERS).calls == 0)
    checks.that(ledger.without("Iallreduce", "Allreduce").calls == len(node))  # the handshake aside
    want_sum = np.sum([contribution(r, "float32", 4096) for r in range(world.size)], axis=0)
    checks.that(np.array_equal(got, want_sum))
    checks.agree(world.comm, f"{ledger.log}")
    strategy.experimental_finalize()


def test_the_optimizer_step_takes_the_strategys_implementation(world):
    """SGD over a HIERARCHICAL strategy: w - lr * the sum of the replicas' gradients (tf's aggregation)."""
    strategy = mpistrat.MPIStrategy(world.comm, communication_options=HIERARCHICAL)
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(64, np.float32))
        opt = mpistrat.optimizers.SGD(0.5)
    grads = contribution(world.rank, "float32", 64)
    strategy.run(lambda: opt.apply_gradients([(grads, w)]))
    total = np.sum([contribution(r, "float32", 64) for r in range(world.size)], axis=0)
    all_ranks_agree(world.comm, np.array_equal(w.numpy(), -0.5 * total), f"{w.numpy()[:4]}")
    strategy.experimental_finalize()


@pytest.mark.mpi(min_size=2)
def test_ranks_that_would_sum_differently_raise_instead_of_waiting(world):
    """One rank asks for HIERARCHICAL, the others for flat MPI: they would wait in different
    communicators' collectives; the handshake names the difference on every rank."""
    c = world.strategy.extended.collectives
    impl = "HIERARCHICAL" if world.rank == 0 else "RING"
    raises_on_every_rank(
        world.comm,
        CollectiveMismatchError,
        lambda: c.all_reduce("sum", np.ones(3), CommunicationOptions(implementation=impl)),
        "different CommunicationOptions.implementation: rank 0: HIERARCHICAL; rank",
    )
    raises_on_every_rank(
        world.comm,
        CollectiveMismatchError,
        lambda: mpistrat.MPIStrategy(
            world.comm, communication_options=CommunicationOptions(implementation=impl)
        ),
        "the same CommunicationOptions.implementation",
    )


@pytest.mark.mpi(min_size=2)
def test_one_array_and_the_nest_path_agree_under_a_hierarchical_strategy(world):
    """One array alone takes a shorter path than a nest, or than a call with options; under a
    HIERARCHICAL strategy both must mix the route into the handshake alike, or ranks on different
    paths would raise on a call that agrees."""
    strategy = mpistrat.MPIStrategy(world.comm, communication_options=HIERARCHICAL)
    try:
        c = strategy.extended.collectives
        mine = contribution(world.rank, "float64", 7)
        want = np.sum([contribution(r, "float64", 7) for r in range(world.size)], axis=0)
        c.all_reduce("sum", [mine])  # every rank has seen "sum": the one-array path takes it next
        options = CommunicationOptions() if world.rank % 2 else None  # the nest path on odd ranks
        got = c.all_reduce("sum", mine, options)
        all_ranks_agree(world.comm, np.array_equal(got, want), f"{got} vs {want}")
    finally:
        strategy.experimental_finalize()


def test_the_name_is_accepted_as_tf_accepts_the_others():
    assert CommunicationOptions(implementation="hierarchical").implementation is (
        CommunicationImplementation.HIERARCHICAL
    )
