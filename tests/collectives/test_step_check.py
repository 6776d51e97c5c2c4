"""``check="step"`` (``MPISTRAT_CHECK=step``): the first step is checked call by call; after it a
data collective sends nothing of its own and is checked by the step's one handshake
(``apply_gradients``', or the one closing ``strategy.run``). Counted on a counting communicator;
results against serial NumPy; a divergence raises on every rank by the end of the step, naming
the first collective that differed, and every rank checks call by call again after it. Each test
runs under both twins of the step check's state (``step_twin``)."""

from __future__ import annotations

import numpy as np
import pytest

import mpistrat
from mpistrat import CollectiveMismatchError, CommunicationOptions
from mpistrat.optimizers import SGD
from tests.conftest import WORLD, RankChecks, all_ranks_agree, raises_on_every_rank
from tests.support.counting import CountingComm, Ledger

pytestmark = pytest.mark.usefixtures("step_twin")  # every test under each twin

SMALL = 8  # a latency-bound step: 8 one-element all_reduces
HANDSHAKE = ("Allreduce", 104)  # the ledger's name for the handshake's Iallreduce of 13 int64


def make(check):
    return mpistrat.MPIStrategy(CountingComm(WORLD), communication_options=CommunicationOptions(check=check))


def small_step(rank):
    """8 all_reduces of one float32 each; returns their sums."""
    ctx = mpistrat.get_replica_context()
    return [ctx.all_reduce("sum", np.array([rank + i], np.float32)) for i in range(SMALL)]


def expected_sums(size):
    """Serial NumPy: the sum over ranks of each call's value."""
    return [np.float32(sum(np.float32(r + i) for r in range(size))) for i in range(SMALL)]


def calls(ledger):
    return [(c.name, c.sent) for c in ledger.log]


@pytest.mark.parametrize("check", ["step", True, False])
def test_a_repeated_step_sends_one_control_collective_under_step(check):
    """Counted per step after the first: ``step`` makes the 8 data calls and one 104-byte handshake
    (the run's closing one), ``True`` one handshake more per call, ``False`` the data calls alone;
    every setting sums alike."""
    strategy = make(check)
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    strategy.run(small_step, args=(rank,))  # the first occurrence, checked in full
    with Ledger.recording() as ledger:
        got = strategy.run(small_step, args=(rank,))
    strategy.experimental_finalize()
    data = [c for c in calls(ledger) if c != HANDSHAKE]
    control = [c for c in calls(ledger) if c == HANDSHAKE]
    handshake = HANDSHAKE
    closing = [handshake] if size > 1 and check else []
    want_control = {"step": closing, True: [handshake] * SMALL + closing, False: []}[check]
    checks = RankChecks()
    checks.that(data == [("Allreduce", 4)] * SMALL)
    checks.that(control == want_control)
    checks.that([g[0] for g in got] == expected_sums(size))
    checks.agree(WORLD, f"check={check}: {calls(ledger)}, got {got}")


def test_the_first_step_is_checked_call_by_call_and_again_after_an_error():
    """In the first step (and after any failed handshake) every collective opens with its handshake:
    ranks that pass different shapes raise at the call itself, and the next call works."""
    if WORLD.Get_size() < 2:
        pytest.skip("ranks can only differ with 2 or more")
    strategy = make("step")
    rank, size = WORLD.Get_rank(), WORLD.Get_size()

    def shapes():
        return mpistrat.get_replica_context().all_reduce("sum", np.ones(3 if rank == 0 else 5, np.float32))

    checks = RankChecks()
    for _ in range(2):  # the first step, then the one after the error
        message = raises_on_every_rank(
            WORLD, CollectiveMismatchError, lambda: strategy.run(shapes), "shape (5,)"
        )
        checks.that("all_reduce (collective #" in message and "unchecked" not in message)
    got = strategy.run(small_step, args=(rank,))  # every rank at the same point after it
    strategy.run(small_step, args=(rank,))
    with Ledger.recording() as ledger:
        again = strategy.run(small_step, args=(rank,))
    strategy.experimental_finalize()
    checks.that([g[0] for g in got] == [g[0] for g in again] == expected_sums(size))
    checks.that(calls(ledger).count(HANDSHAKE) == 1)  # the first clean step ended the checking call by call
    checks.agree(WORLD, f"{message}; {calls(ledger)}")


@pytest.mark.parametrize("differ", ["reduce op", "shape"])
def test_a_divergence_after_the_first_step_raises_on_every_rank_naming_the_first(differ):
    """After a clean first step the last rank calls differently: SUM for MEAN (both seen before), or a
    shape of the same size it never passed. MPI moves the same bytes either way, so nothing stops the
    transfer: the run's closing handshake raises on every rank, naming the first collective in which
    the ranks differed, and the ranks go on together."""
    size = WORLD.Get_size()
    if size < 2:
        pytest.skip("ranks can only differ with 2 or more")
    strategy = make("step")
    rank = WORLD.Get_rank()
    x = np.ones(4, np.float32)

    def step(other):
        ctx = mpistrat.get_replica_context()
        if not other:
            return [ctx.all_reduce("sum", x), ctx.all_reduce("mean", x)]
        if differ == "reduce op":
            return [ctx.all_reduce("mean", x), ctx.all_reduce("sum", x)]
        return [ctx.all_reduce("sum", x.reshape(2, 2)), ctx.all_reduce("mean", x)]

    strategy.run(step, args=(False,))
    first = strategy.extended.collectives.seq + 1  # the next run's first all_reduce
    message = raises_on_every_rank(
        WORLD,
        CollectiveMismatchError,
        lambda: strategy.run(step, args=(rank == size - 1,)),
        match=f"collective #{first} ran unchecked",
    )
    checks = RankChecks()
    checks.that(f"rank {size - 1}: all_reduce" in message)
    got = strategy.run(step, args=(False,))  # the ranks go on together after the error
    strategy.experimental_finalize()
    checks.that(np.array_equal(got[0], np.full(4, size, np.float32)))
    checks.that(np.array_equal(got[1], x))
    checks.agree(WORLD, message)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_unchecked_reduce_after_the_last_step_is_checked_when_the_strategy_is_finalized(dtype):
    """A cross-replica reduce after the last step sends nothing under step, and no later step checks
    it: finalizing does, on every rank, before the communicator goes (shapes of the same size)."""
    size = WORLD.Get_size()
    if size < 2:
        pytest.skip("ranks can only differ with 2 or more")
    strategy = make("step")
    rank = WORLD.Get_rank()
    strategy.run(small_step, args=(rank,))
    value = np.ones((3, 2) if rank == size - 1 else (2, 3), dtype)
    strategy.reduce("sum", value, axis=None)  # unchecked: MPI moves the same bytes
    seq = strategy.extended.collectives.seq
    message = raises_on_every_rank(
        WORLD,
        CollectiveMismatchError,
        strategy.experimental_finalize,
        match=f"collective #{seq} ran unchecked",
    )
    all_ranks_agree(WORLD, f"rank {size - 1}: reduce" in message, message)


def test_calls_numbered_apart_by_bad_input_on_some_ranks_raise_on_every_rank():
    """Bad input at an unchecked call is raised on its rank alone, after taking its number. If it
    comes first on some ranks and second on others, each rank's good call meets another number on
    the others (same arguments, so MPI pairs them and sums): the step's closing handshake raises
    on every rank, naming both numbers, instead of returning those sums."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    if size < 2:
        pytest.skip("ranks can only differ with 2 or more")
    strategy = make("step")

    def step(order):
        ctx = mpistrat.get_replica_context()
        out = []
        for i, what in enumerate(order):
            try:
                out.append(ctx.all_reduce("sum", np.full(2, i + 1, np.float32) if what else "not an array"))
            except mpistrat.UnsupportedTypeError:  # raised on this rank alone under step
                out.append(None)
        return out

    strategy.run(step, args=([True, True],))  # the first step, checked call by call
    first = strategy.extended.collectives.seq + 1
    order = [True, False] if rank == size - 1 else [False, True]
    message = raises_on_every_rank(
        WORLD, CollectiveMismatchError, lambda: strategy.run(step, args=(order,)), match="ran unchecked"
    )
    checks = RankChecks()
    checks.that(f"all_reduce #{first}" in message)
    checks.that(f"all_reduce #{first + 1}" in message)
    got = strategy.run(step, args=([True, True],))  # the ranks go on together after the error
    strategy.experimental_finalize()
    checks.that(all(np.array_equal(g, np.full(2, size * (i + 1), np.float32)) for i, g in enumerate(got)))
    checks.agree(WORLD, message)


def test_a_training_step_is_one_control_collective():
    """Under ``step`` the optimizer's handshake is the step's one control collective: it checks what
    ran unchecked before any weight is written, and the run's closing handshake, with nothing left
    unchecked, sends nothing. The weights match serial NumPy SGD on the replicas' summed gradients."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    strategy = make("step")
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(3, np.float32), name="w")
        opt = SGD(0.5)
    base = np.array([1.0, 2.0, 4.0], np.float32)

    def step():
        loss = mpistrat.get_replica_context().all_reduce("sum", np.float32(rank))  # a metric, say
        opt.apply_gradients([(base * np.float32(rank + 1), w)])
        return loss

    strategy.run(step)  # built, and the first occurrence checked
    with Ledger.recording() as ledger:
        strategy.run(step)
        strategy.run(step)
    strategy.experimental_finalize()
    total = np.sum([base * np.float32(r + 1) for r in range(size)], axis=0, dtype=np.float32)  # tf sums
    reference = np.zeros(3, np.float32)
    for _ in range(3):
        reference = reference - np.float32(0.5) * total
    control = [c for c in calls(ledger) if c == HANDSHAKE]
    checks = RankChecks()
    checks.that(len(control) == 2)  # one per step
    checks.that(np.allclose(w.numpy(), reference, rtol=1e-6))
    checks.that(len(calls(ledger)) == 6)  # and per step, the loss's sum and the gradients' pack
    checks.agree(WORLD, f"{calls(ledger)}; w {w.numpy()} vs {reference}")


def test_a_step_that_closes_sending_nothing_is_still_the_last_collective_finished():
    """A learned step with nothing unchecked sends no closing handshake, but its closing is numbered
    like one: what a stall report or a rank's exit names as its last finished collective is that
    closing, on every rank. Then a step with a collective closes with one handshake, numbered next."""
    if WORLD.Get_size() == 1:
        pytest.skip("one replica's strategy.run has no closing")
    strategy = make("step")
    collectives = strategy.extended.collectives
    strategy.run(small_step, args=(WORLD.Get_rank(),))  # the first step, checked call by call
    with Ledger.recording() as ledger:
        strategy.run(lambda: None)
    seq, monitor = collectives.seq, collectives.monitor
    checks = RankChecks()
    checks.that(ledger.log == [])
    checks.that(monitor.completed == seq)
    checks.that(monitor.last[:2] == ("strategy.run (result)", seq))
    got = strategy.run(small_step, args=(WORLD.Get_rank(),))
    checks.that(monitor.last[:2] == ("strategy.run (result)", seq + SMALL + 1))
    checks.that(got == expected_sums(WORLD.Get_size()))
    strategy.experimental_finalize()
    checks.agree(WORLD, f"seq {seq}, completed {monitor.completed}, last {monitor.last}")
