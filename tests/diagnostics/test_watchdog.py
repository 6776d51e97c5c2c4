"""The watchdog, the abort hook and the rank-aware logger, in process (the faults: test_faults.py)."""

import logging
import os
import re
import sys
import threading
import time

import numpy as np
import pytest

import mpistrat
from mpistrat import CommunicationOptions
from mpistrat.diagnostics import abort, diagnosis, farewell, flight, watchdog
from mpistrat.diagnostics.callsite import call_site
from mpistrat.log import RankFilter, logger
from tests.conftest import all_ranks_agree
from tests.support.counting import CountingComm, Ledger


def test_timeout_that_does_not_expire_changes_nothing(group):
    """With a timeout the opening handshake is polled; the results are the same."""
    options = CommunicationOptions(timeout_seconds=60)
    strategy = group.strategy

    def step():
        ctx = mpistrat.get_replica_context()
        reduced = ctx.all_reduce("sum", {"a": np.arange(3.0), "b": group.rank}, options)
        gathered = ctx.all_gather(np.array([group.rank]), axis=0, options=options)
        merged = ctx.merge_call(lambda s, v: s.reduce("sum", v), args=(np.ones(2),))
        return reduced, gathered, merged

    reduced, gathered, merged = strategy.run(step)
    n = group.size
    ok = (
        np.array_equal(reduced["a"], np.arange(3.0) * n)
        and int(reduced["b"]) == n * (n - 1) // 2
        and gathered.tolist() == list(range(n))
        and merged.tolist() == [n, n]
    )
    all_ranks_agree(group.comm, ok, f"{reduced} {gathered} {merged}")


def test_timeout_from_env_applies_to_new_strategies(world, monkeypatch):
    monkeypatch.setenv("MPISTRAT_TIMEOUT", "30")
    strategy = mpistrat.MPIStrategy(world.comm)
    monitor = strategy.extended.collectives.monitor
    assert monitor.env_timeout == 30.0 and monitor.env_polled
    got = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1.0))
    all_ranks_agree(world.comm, got == world.size)
    strategy.experimental_finalize()


def test_monitor_marks_the_collective_while_it_runs(world):
    monitor = world.strategy.extended.collectives.monitor
    seen = {}

    def merge_fn(strategy):
        seen["inside"] = monitor.start  # rank 0, between the gather and the broadcast

    world.strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn))
    assert monitor.start is None
    if world.size > 1:
        # merge_call's last transfer, then strategy.run's closing handshake
        assert monitor.watched and monitor.last[0] == "strategy.run (result)"
    if world.rank == 0:
        assert seen["inside"] is None


def test_single_rank_strategies_are_not_watched():
    strategy = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
    assert not strategy.extended.collectives.monitor.watched


def test_call_site_is_the_first_frame_outside_mpistrat():
    assert call_site().startswith("tests/diagnostics/test_watchdog.py:")
    assert call_site().endswith("in test_call_site_is_the_first_frame_outside_mpistrat")


def test_diagnose_asks_every_rank_where_it_is(world):
    """Every rank asks at once (each answers the others meanwhile): nobody is in a collective."""
    if world.size < 2:
        pytest.skip("needs 2 ranks")
    monitor = world.strategy.extended.collectives.monitor
    world.comm.Barrier()
    explanation, waiting = watchdog.WATCHDOG.diagnose(monitor, start=monitor.start, grace=30.0)
    world.comm.Barrier()
    others = [r for r in range(world.size) if r != world.rank]
    ok = waiting == [world.rank] and all(f"rank {r} is not in a collective" in explanation for r in others)
    all_ranks_agree(world.comm, ok, explanation)


def state(rank, seq=None, kind=None, world=None, agreed=False):
    """Rank ``rank``'s answer: in collective ``seq`` (``kind``; ``agreed``: past its handshake), or not."""
    waited = None if seq is None else 1.0
    world = rank if world is None else world
    return {
        "world": world,
        "seq": seq or 1,
        "kind": kind,
        "waited": waited,
        "agreed": agreed,
        "last": None,
        "site": "x.py:1",
    }


def test_explain_names_the_missing_ranks_and_counts_known_ones_as_waiting():
    answers = {0: state(0, 2, "all_reduce"), 1: state(1), 3: state(3, 2, "all_gather", world=7)}
    explanation, waiting = diagnosis.explain(2, "all_reduce", answers, 5, known={4}, listened=1.0)
    assert waiting == [0, 4]
    assert explanation == (
        "waiting for ranks 1, 3: rank 1 is not in a collective (no collective yet); it is at x.py:1; "
        "rank 3 (world 7) is in all_gather (collective #2) at x.py:1; "
        "rank 2 did not answer within 1 s (slow to answer, or killed, or blocked outside Python). "
        "Waiting in it: ranks 0, 4"
    )
    everyone = diagnosis.explain(2, "all_reduce", {0: state(0, 2, "all_reduce")}, 1, set(), 1.0)
    assert everyone == ("every rank is in it now", [0])
    nobody = diagnosis.explain(2, "all_reduce", {0: state(0)}, 2, set(), 1.0)
    assert nobody == ("no rank is waiting in it any more", [])


def test_explain_blames_no_rank_once_the_handshake_proved_every_rank_entered():
    """A long transfer: ranks busy inside it may answer late, but they are not missing."""
    answers = {0: state(0, 2, "all_gather", agreed=True), 1: state(1, 2, "all_gather", agreed=True)}
    explanation, waiting = diagnosis.explain(2, "all_gather", answers, 3, known=set(), listened=1.0)
    assert waiting == [0, 1]
    assert explanation == (
        "every rank has entered it (its opening handshake completed): a long transfer, not a missing rank; "
        "rank 2 did not answer within 1 s (busy inside it)"
    )
    assert "did not answer (" not in explanation
    before = {0: state(0, 2, "all_gather"), 1: state(1, 2, "all_gather")}  # still in the handshake
    assert (
        "rank 2 did not answer within 1 s (slow"
        in diagnosis.explain(2, "all_gather", before, 3, set(), 1.0)[0]
    )


def test_the_handshake_marks_the_collective_entered_by_every_rank(world, monkeypatch):
    if world.size < 2:
        pytest.skip("needs 2 ranks")
    collectives = world.strategy.extended.collectives
    monitor, get, seen = collectives.monitor, collectives.transports.get, {}

    class Spy:  # records this rank's answer from inside the transfer, past the handshake
        def __init__(self, transport):
            self.transport = transport

        def allgatherv(self, *args):
            seen["state"] = monitor.state()
            return self.transport.allgatherv(*args)

    monkeypatch.setattr(collectives.transports, "get", lambda *args: Spy(get(*args)))
    collectives.all_gather(np.arange(2.0), axis=0)
    inside = seen["state"]
    ok = inside["agreed"] and inside["kind"] == "all_gather" and not monitor.state()["agreed"]
    all_ranks_agree(world.comm, ok, f"{inside}")


class Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_one_stall_costs_side_channel_messages_linear_in_the_ranks(world, monkeypatch):
    """The last rank is late: one warning names it, and all ranks together send at most 4(R-1) messages.

    (Asking from every waiting rank took 2(R-1)²; tests/diagnostics/test_faults.py checks more cases.)
    """
    if world.size < 2:
        pytest.skip("needs 2 ranks")
    monkeypatch.setenv("MPISTRAT_STALL_WARNING_SECONDS", "1")
    strategy = mpistrat.MPIStrategy(CountingComm(world.comm))
    kept, late = Kept(), world.size - 1
    logger.addHandler(kept)
    try:
        step = lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(2))  # noqa: E731
        strategy.run(step)
        with Ledger.recording() as ledger:
            if world.rank == late:
                time.sleep(2.5)
            strategy.run(step)
            time.sleep(0.3)  # anything the watchdog still sends about this stall is counted too
    finally:
        logger.removeHandler(kept)
        strategy.experimental_finalize()
    messages = world.comm.allreduce(ledger.only("issend").calls)
    warnings = [m for ms in world.comm.allgather([m for m in kept.messages if "has waited" in m]) for m in ms]
    ok = (
        0 < messages <= 4 * (world.size - 1)
        and len(warnings) == 1
        and f"waiting for rank {late}: rank {late} is not in a collective" in warnings[0]
    )
    all_ranks_agree(world.comm, ok, f"{messages} messages at {world.size} ranks; warnings: {warnings}")


def test_finalize_stops_watching(world):
    strategy = mpistrat.MPIStrategy(world.comm)
    monitor = strategy.extended.collectives.monitor
    strategy.experimental_finalize()
    assert not monitor.watched and monitor not in watchdog.WATCHDOG.registry


# -- abort on exception -----------------------------------------------------------


def test_abort_hook_is_installed_and_can_be_turned_off(monkeypatch):
    mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
    assert sys.excepthook is abort._excepthook
    monkeypatch.setattr(abort, "_enabled", None)
    monkeypatch.setenv("MPISTRAT_ABORT_ON_EXCEPTION", "0")
    assert not abort.enabled()
    monkeypatch.setenv("MPISTRAT_ABORT_ON_EXCEPTION", "1")
    assert abort.enabled()
    mpistrat.set_abort_on_exception(False)
    assert not abort.enabled()


def test_disabled_hook_hands_over_to_the_previous_one(monkeypatch):
    calls = []
    monkeypatch.setattr(abort, "_previous_hook", lambda *args: calls.append(args[0]))
    monkeypatch.setattr(abort, "_enabled", False)
    abort._excepthook(KeyError, KeyError("x"), None)
    assert calls == [KeyError]


class Ended(Exception):
    """What the patched MPI_Abort raises instead of ending the test run."""


def test_ctrl_c_on_a_rank_is_one_line_where_it_stopped_and_status_130(monkeypatch, capsys):
    """The launcher passes Ctrl-C to every rank: a traceback and flight records from each would bury
    the one thing to say; a shell reports SIGINT as 130."""

    def end(*args, code=1):
        raise Ended(args[-1] if args and isinstance(args[-1], int) else code)

    monkeypatch.setattr(abort, "_enabled", True)
    monkeypatch.setattr(abort, "_in_parallel_job", lambda: True)
    monkeypatch.setattr(abort, "_end", end)
    monkeypatch.setattr(abort, "abort_job", end)
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as exc:
        line = sys._getframe().f_lineno - 2
        with pytest.raises(Ended) as ended:
            abort._excepthook(KeyboardInterrupt, exc, exc.__traceback__)
    assert ended.value.args == (130,)
    err = capsys.readouterr().err
    where = f"{call_site().split(':')[0]}:{line} in {sys._getframe().f_code.co_name}"
    rank = mpistrat.MPI.COMM_WORLD.Get_rank()
    assert err == f"[rank {rank}] mpistrat: interrupted at {where}; calling MPI_Abort to end the job\n", err


def test_an_aborting_ranks_flight_records_name_their_strategy_in_creation_order(world):
    first, second = mpistrat.MPIStrategy(world.comm), mpistrat.MPIStrategy(world.comm)
    for strategy in (second, first):
        strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(2)))
    text = flight.last_words()
    ranks = f"{world.size} rank{'s' if world.size > 1 else ''}"
    labels = [s.extended.collectives.flight.label for s in (first, second)]
    numbers = [re.fullmatch(rf"MPIStrategy #(\d+) \({ranks}\)", label) for label in labels]
    at = [text.find(f"\n  {label}: #1 strategy creation") for label in labels]
    ok = all(numbers) and int(numbers[0][1]) < int(numbers[1][1]) and 0 < at[0] < at[1]
    for strategy in (first, second):
        strategy.experimental_finalize()
    all_ranks_agree(world.comm, ok, f"{labels}\n{text}")


# -- logging ----------------------------------------------------------------------


def make_record(level, **extra):
    record = logging.LogRecord("mpistrat", level, __file__, 1, "message", None, None)
    record.__dict__.update(extra)
    return record


def test_records_carry_the_rank_and_warnings_come_from_rank_0(world, monkeypatch):
    monkeypatch.delenv("MPISTRAT_LOG_ALL_RANKS", raising=False)
    rank_filter = RankFilter()
    warning, error = make_record(logging.WARNING), make_record(logging.ERROR)
    assert rank_filter.filter(warning) == (world.rank == 0)
    assert warning.rank == mpistrat.MPI.COMM_WORLD.Get_rank()
    assert rank_filter.filter(error)
    assert rank_filter.filter(make_record(logging.WARNING, any_rank=True))
    monkeypatch.setenv("MPISTRAT_LOG_ALL_RANKS", "1")
    assert rank_filter.filter(make_record(logging.WARNING))


def test_logger_prints_with_the_rank(capsys):
    logger.error("something broke")
    assert (
        f"[mpistrat rank {mpistrat.MPI.COMM_WORLD.Get_rank()}] ERROR: something broke"
        in capsys.readouterr().err
    )


def test_dropped_strategies_free_their_communicators(world):
    """Without experimental_finalize(): MPI has ~2,048 communicators, and each strategy used one for good."""
    import gc

    if world.size != 2:  # 2,100 collective creations and frees: 14 s alone, 28 s at 3 oversubscribed ranks
        pytest.skip("the communicator limit is per process: 2 ranks, whose frees are collective, prove it")

    gc.collect()
    watchdog.WATCHDOG.reap(block=True)  # earlier tests' dropped strategies leave the registry first
    before = len(watchdog.WATCHDOG.registry)  # the fixtures' strategies
    for i in range(2100):
        strategy = mpistrat.MPIStrategy(world.comm)
        del strategy
        if i % 50 == 0:
            gc.collect()
    gc.collect()
    watchdog.WATCHDOG.reap(
        block=True
    )  # those collected while the watchdog held its lock wait for its next look
    live = len(watchdog.WATCHDOG.registry) - before
    last = mpistrat.MPIStrategy(world.comm)  # still possible, and it works
    got = last.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1.0))
    all_ranks_agree(world.comm, got == world.size and live == 0, f"{got}, {live} monitors still watched")


class Untouchable:
    """A lock that fails the test when the test's own thread takes it. The watchdog thread, which
    looks a few times a second and may do so while the test runs, takes the real one."""

    def __init__(self, real):
        self.real, self.owner = real, threading.get_ident()

    def acquire(self, blocking=True, timeout=-1):
        if threading.get_ident() == self.owner:
            raise AssertionError("the side channel was touched")
        return self.real.acquire(blocking, timeout)

    def release(self):
        self.real.release()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False


def test_a_forked_child_does_not_announce_that_its_rank_left(monkeypatch):
    """A child made by os.fork() inherits the exit hook; only the rank's own process may say it left."""
    monkeypatch.setattr(watchdog.WATCHDOG, "lock", Untouchable(watchdog.WATCHDOG.lock))
    monkeypatch.setattr(watchdog.WATCHDOG, "pid", -1)  # as in a child: another process
    farewell.leave(watchdog.WATCHDOG)  # returns before the side channel
    monkeypatch.setattr(watchdog.WATCHDOG, "pid", os.getpid())  # the rank itself goes on to it
    with pytest.raises(AssertionError, match="the side channel was touched"):
        farewell.leave(watchdog.WATCHDOG)


def test_a_stall_warning_says_how_long_it_has_waited_when_it_is_printed(monkeypatch):
    """The stall is noticed at 1 s, and its diagnosis comes 4 s later (a rank that does not answer
    holds the listening for LISTEN): the warning printed then says 5 s, the wait so far. On a clock
    of this thread's own, so nothing here depends on timing."""
    import types

    from mpistrat.diagnostics import watchdog

    me, real = threading.current_thread(), watchdog.time.monotonic
    clock = iter([101.0, 105.0])
    fake = types.SimpleNamespace(
        monotonic=lambda: next(clock) if threading.current_thread() is me else real(), sleep=time.sleep
    )
    monkeypatch.setattr(watchdog, "time", fake)
    dog = watchdog.Watchdog()
    answers = iter([None, ("rank 1 did not answer within 4 s", -1)])
    monkeypatch.setattr(dog, "result", lambda mon, event, now: next(answers))
    said = []
    monkeypatch.setattr(watchdog, "_warn", lambda mon, start, waited, result: said.append(waited))
    mon = types.SimpleNamespace(
        start=100.0, seq=3, kind="all_reduce", side=None, deadline=None, handled=None,
        stall_after=1.0, warned=None,
    )  # fmt: skip
    dog.tend(mon)  # 1 s: noticed, the diagnosis asked for
    dog.tend(mon)  # 5 s: the diagnosis is here
    assert said == [5.0], said
