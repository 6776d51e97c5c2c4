"""Watch collectives: warn when one stalls, end the job when one times out, and say who is missing.

The main thread marks entering and leaving a collective on the strategy's :class:`Monitor`
(a few attribute writes, see :func:`collective`). One daemon thread per process looks at
every watched strategy a few times a second. mpi4py releases the GIL inside blocking MPI
calls, so it runs while the main thread waits.

* After ``MPISTRAT_STALL_WARNING_SECONDS`` (default 60) in one collective, the lowest
  waiting rank logs one warning for all of them, naming the ranks that have not arrived
  and where they are instead.
* At ``timeout_seconds`` (``CommunicationOptions`` or ``MPISTRAT_TIMEOUT``) every waiting
  rank gets the same diagnosis; if the main thread is waiting in a request it polls (the
  opening handshake), that thread raises :class:`~mpistrat.errors.CollectiveTimeoutError`;
  either way the job then ends with ``MPI_Abort``, since a half-done collective leaves the
  communicator unusable.

Who is missing is asked over a side channel: point-to-point messages with a reserved
tag on the strategy's private communicator. MPI never matches point-to-point messages
with collectives, so this traffic cannot disturb the collective in progress, and no
second communicator is needed. Every rank's watchdog answers a query with where its
main thread is (inside which collective, or at which line of the program); a rank that
does not answer has exited, was killed, or is stuck outside Python. This needs MPI
thread level ``MULTIPLE`` (mpi4py's default); below it there is no side channel and the
messages say the missing ranks are unknown.

One rank diagnoses each event (a stall or a timeout of one collective, keyed by
``(seq, kind, "stall" | "timeout")``) for everyone, so an event costs O(R) messages, not
one query round per waiting rank (which is 2(R-1)² messages with one straggler):

1. A waiting rank whose stall or timeout comes sends one ``report`` to the coordinator,
   rank 0 of the communicator. Rank 0's watchdog thread runs even while its main thread
   computes elsewhere, so rank 0 coordinates even when it is the missing rank.
2. The coordinator diagnoses the first report of an event itself (rank 0 waiting in the
   collective starts on its own timer): one ``query`` to every other rank and their
   ``answer``, gathered until every rank answered or ``LISTEN`` seconds passed, without
   blocking its thread. Ranks oversubscribed on few cores answer late; a rank that does
   not answer is named as such ("slow to answer, or killed, ..."), never as gone.
3. It sends the ``result`` to every rank that reported or was found waiting, so ranks
   whose own timer comes later already have it and report nothing. A report that comes
   after the result is answered with it directly. Only the rank that prints the diagnosis
   (the lowest waiting one) gets its O(R) text; the others get a line that points to it.

Per event that is at most R-1 reports, R-1 queries, R-1 answers and R-1 results, O(R)
bytes in all. A
reporter that has no result ``WAIT`` seconds after reporting reports to the next rank
(1, then 2, ...), and diagnoses the event itself when its own rank comes up, so a
stopped or finished rank 0 costs ``WAIT`` seconds and R-1 reports per rank passed over,
and the explanation says who stood in. A timeout whose diagnosis has not come
``PATIENCE`` seconds after the deadline is handled with an explanation that says so.

>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> Collectives(MPI.COMM_SELF).monitor.watched  # one rank cannot stall
False
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import inspect
import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from mpi4py import MPI

from mpistrat import config
from mpistrat.diagnostics import abort, flight, stragglers, timeline
from mpistrat.diagnostics.callsite import call_site
from mpistrat.errors import CollectiveTimeoutError, ContextError
from mpistrat.log import ANY_RANK, logger

__all__ = ["WATCHDOG", "Monitor", "Watchdog", "collective", "duplicate", "unwatch", "wait", "watch"]

TAG = 0x6D73  # reserved on the private communicator for the watchdog's messages
POLL = 0.1  # seconds between the watchdog's looks (and the latency of its answers)
GRACE = 1.0  # seconds diagnose() waits for answers to a query by default
LISTEN = 4.0  # seconds a diagnosis waits for every answer: oversubscribed ranks answer late, not never
WAIT = LISTEN + 5 * POLL  # seconds a reporter waits for a result before reporting to the next rank
PATIENCE = 2 * WAIT + LISTEN  # seconds after a deadline to wait for its diagnosis (one stand-in fits)
ABORT_DELAY = 5.0  # seconds between a raised CollectiveTimeoutError and MPI_Abort

_KEEP = 32  # events remembered per strategy (results, reports)
NO_SIDE_CHANNEL = "which ranks are missing is unknown (MPI thread level is below MULTIPLE: no side channel)"
FINALIZED = "which ranks are missing is unknown (the strategy was finalized)"

F = TypeVar("F", bound=Callable[..., Any])
Event = tuple[int, str, str]  # (seq, kind, "stall" | "timeout"): one event of one collective
Result = tuple[str, int]  # (who is missing and where, the rank that prints it: -1 each rank)


@dataclasses.dataclass
class Diagnosis:
    """An event this rank diagnoses: its query, when to stop waiting, who to tell besides the waiting."""

    qid: int
    began: float
    reporters: set[int]


class Monitor:
    """What one strategy's collectives are doing: written by the main thread, read by the watchdog."""

    def __init__(self, collectives: Any):
        self.owner = weakref.ref(collectives)
        self.comm: MPI.Intracomm = collectives.comm
        self.rank, self.size = collectives.rank, collectives.size
        self.watched = self.size > 1
        self.kind = ""
        self.start: float | None = None  # monotonic time the current collective began; None: idle
        self.deadline: float | None = None
        self.polled = False  # the current collective's timeout was chosen: its handshake polls, to raise
        self.busy = threading.Lock()  # held by the thread inside a collective: one thread at a time
        self.thread: int | None = None  # that thread
        self.last_thread: int | None = None  # the thread of the last collective (where the program is)
        self.last: tuple[str, int, float] | None = None  # (kind, seq, end time) of the last collective
        self.polling = False  # the main thread waits in wait(), so it can raise
        self.agreed: float | None = None  # start of the collective whose opening handshake completed
        self.expired: str | None = None  # set by the watchdog: the timeout message
        self.warned: float | None = None
        self.handled: float | None = None
        self.env_timeout: float | None = None
        self.env_polled = False  # MPISTRAT_TIMEOUT is set (not the default): polled, so it raises
        self.stall_after: float | None = None
        self.completed = 0  # the last collective this rank completed (not one it left by an error)
        self.departed: dict[int, tuple[int, str]] = {}  # rank -> (its last collective, why) after it exited
        self.side = False
        self.noticed: tuple[float, float] | None = None  # (start, time) this rank saw the stall
        # Side-channel state, touched under WATCHDOG.lock:
        self.answers: dict[int, dict[int, dict[str, Any]]] = {}  # query id -> rank -> its state
        self.diagnosing: dict[Event, Diagnosis] = {}  # events this rank diagnoses for everyone
        self.results: dict[Event, Result] = {}  # made here or sent by the rank that diagnosed
        self.reported: dict[Event, tuple[int, float]] = {}  # (rank reported to, when)
        self.told: dict[Event, set[int]] = {}  # the ranks a result was sent to (each gets it once)

    @property
    def seq(self) -> int:
        owner = self.owner()
        return -1 if owner is None else owner.seq

    def state(self) -> dict[str, Any]:
        """Where this rank is now: inside which collective, or where its program is."""
        now, start = time.monotonic(), self.start
        thread = self.thread or self.last_thread or threading.main_thread().ident
        frame = sys._current_frames().get(thread) if thread is not None else None
        return {
            "world": MPI.COMM_WORLD.Get_rank(),
            "seq": self.seq,
            "kind": self.kind if start is not None else None,
            "waited": None if start is None else now - start,
            # Past the opening handshake (an all-reduce): every rank has entered this collective.
            "agreed": start is not None and self.agreed == start,
            "last": None if self.last is None else (self.last[0], self.last[1], now - self.last[2]),
            "site": call_site(frame) if frame is not None else "<no Python frame>",
            "flight": _flight(self, now, start),
        }


def _flight(mon: Monitor, now: float, start: float | None) -> str | None:
    owner = mon.owner()
    if owner is None or not hasattr(owner, "flight"):
        return None
    busy = start is not None
    return owner.flight.describe(now, busy=busy, agreed=busy and mon.agreed == start)


def _records(mon: Monitor, answers: dict[int, dict[str, Any]]) -> str:
    """Every rank's flight record (from the answers), to end a diagnosis."""
    owner = mon.owner()
    kept = (owner.flight.maxlen or 0) if owner is not None and hasattr(owner, "flight") else 0
    if not kept:
        return ""
    return flight.block({r: a.get("flight") for r, a in answers.items()}, mon.size, kept)


class Watchdog:
    """The process's watchdog: its thread, the strategies it watches, and its side-channel sends.

    One per process (:data:`WATCHDOG`); the module's functions use it. Its thread starts with
    the first strategy of 2+ ranks and stops at exit, after this rank says it leaves.
    """

    def __init__(self) -> None:
        # Weak: a strategy that is dropped without experimental_finalize() is collected, and its
        # communicator freed (see release), instead of living on here until MPI runs out of them.
        self.registry: weakref.WeakSet[Monitor] = weakref.WeakSet()
        self.lock = threading.Lock()  # guards the registry and every side-channel MPI call
        self.doomed: list[tuple[Monitor, MPI.Intracomm, Callable[[], None] | None]] = []  # to free
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.queries = itertools.count(1)
        self.sends: list[MPI.Request] = []  # side-channel sends in flight (kept alive until complete)
        self.pid = os.getpid()  # a forked child inherits this object and the exit hook, not the rank
        self.exited = False  # the exit hook ran: the thread is stopped and this rank said it leaves
        self.departed: dict[int, str] = {}  # world rank -> why, of every rank any strategy heard leave

    def start(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            return
        self.stop.clear()
        self.thread = threading.Thread(target=self.run, name="mpistrat-watchdog", daemon=True)
        self.thread.start()

    def shutdown(self) -> None:
        """Say this rank leaves, then stop the thread before MPI is finalized (atexit runs before
        mpi4py finalizes MPI).

        Registered when this module is imported, so it runs after the ``atexit`` handlers a
        program registers after ``import mpistrat``: their collectives are still watched, and a
        rank that skips one is named. A collective after this hook is bounded by its timeout alone.
        """
        with contextlib.suppress(Exception):  # a peer that is gone already: nothing to tell it
            announce_exit()
        self.exited = True
        self.stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * POLL + GRACE)

    def run(self) -> None:
        failed: weakref.WeakSet[Monitor] = weakref.WeakSet()
        while not self.stop.wait(POLL):
            if MPI.Is_finalized():
                return
            self.look(failed)  # holds the monitors only while it looks: a dropped strategy stays collectable
            self.reap(block=False)

    def look(self, failed: weakref.WeakSet[Monitor]) -> None:
        with self.lock:
            monitors = list(self.registry)
        for mon in monitors:
            try:
                _serve(mon)
                _advance(mon)
                _tend(mon)
            except Exception:  # the watchdog must never take the job down itself
                if mon not in failed:
                    failed.add(mon)
                    logger.exception(
                        "the collective watchdog failed; stall diagnosis is off for this strategy"
                    )
        with self.lock:
            self.sends[:] = [r for r in self.sends if not r.Test()]

    def reap(self, block: bool) -> None:
        """Free the communicators ``release`` was given, if this thread may now."""
        if not self.doomed:
            return
        if MPI.Is_finalized():
            self.doomed.clear()
            return
        if (
            threading.current_thread() is not threading.main_thread()
            and MPI.Query_thread() < MPI.THREAD_MULTIPLE
        ):
            return
        if not self.lock.acquire(blocking=block):
            return
        try:
            while self.doomed:
                mon, comm, close = self.doomed.pop()
                self.registry.discard(mon)
                mon.watched = False
                if close is not None:
                    close()
                if comm != MPI.COMM_NULL:
                    comm.Free()
        finally:
            self.lock.release()


WATCHDOG = Watchdog()
atexit.register(WATCHDOG.shutdown)  # at import: after the program's own exit handlers (atexit is LIFO)


def watch(collectives: Any) -> Monitor:
    """A monitor for ``collectives``; registered with the watchdog thread when there are 2+ ranks.

    Reads ``MPISTRAT_TIMEOUT`` and ``MPISTRAT_STALL_WARNING_SECONDS`` now (when the strategy is created).
    """
    mon = Monitor(collectives)
    mon.env_timeout = config.read("MPISTRAT_TIMEOUT")
    mon.env_polled = config.given("MPISTRAT_TIMEOUT")
    mon.stall_after = config.read("MPISTRAT_STALL_WARNING_SECONDS")
    if mon.watched:
        mon.side = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        with WATCHDOG.lock:
            WATCHDOG.registry.add(mon)
        WATCHDOG.start()
    WATCHDOG.reap(block=False)  # communicators of collected strategies that could not be freed then
    return mon


def unwatch(mon: Monitor) -> None:
    """Stop watching (before the communicator is freed); takes the lock the watchdog's MPI calls hold."""
    with WATCHDOG.lock:
        WATCHDOG.registry.discard(mon)
    mon.watched = False


def release(
    mon: Monitor, comm: MPI.Intracomm, close: Callable[[], None] | None = None, wait: bool = False
) -> None:
    """Stop watching ``mon``, call ``close``, and free ``comm``: a strategy finalized or garbage-collected.

    Safe from a garbage-collection finalizer in any thread: it never runs after
    ``MPI_Finalize``, never frees a communicator while the watchdog uses it (it takes
    ``WATCHDOG.lock``), and when it cannot take the lock now (``wait`` False and the lock is held,
    perhaps by this very thread, collecting inside a side-channel call) or may not call MPI
    from this thread (thread level below ``MULTIPLE``), it leaves the work to the watchdog
    thread's next look or the next strategy created. ``MPI_Comm_free`` does not communicate
    (it only marks the communicator for deallocation, after its pending operations), so
    ranks may free it at different times.
    """
    WATCHDOG.doomed.append((mon, comm, close))
    WATCHDOG.reap(block=wait)


def collective(default_kind: str) -> Callable[[F], F]:
    """Decorate a ``Collectives`` method: mark this strategy busy in it while it runs.

    The method's ``kind`` and ``options`` arguments (when it has them) name the
    collective and may set its timeout; a collective called inside another one
    (a helper) belongs to the outer one. A second thread calling while one is inside
    a collective of the same strategy gets ``ContextError``: two threads' collectives
    would pair up differently on different ranks.
    """

    def decorate(method: F) -> F:
        names = list(inspect.signature(method).parameters)[1:]
        kind_at = names.index("kind") if "kind" in names else -1
        options_at = names.index("options") if "options" in names else -1

        @functools.wraps(method)
        def watched(self: Any, *args: Any, **kwargs: Any) -> Any:
            mon: Monitor = self.monitor
            me = threading.get_ident()
            if not mon.busy.acquire(blocking=False):
                if mon.thread != me:
                    raise ContextError(_two_threads(mon, me, default_kind))
                return method(self, *args, **kwargs)  # a helper inside this thread's collective: part of it
            mon.thread = me
            try:
                if not (mon.watched or timeline.writer is not None):
                    return method(self, *args, **kwargs)
                kind = args[kind_at] if 0 <= kind_at < len(args) else kwargs.get("kind", default_kind)
                options = args[options_at] if 0 <= options_at < len(args) else kwargs.get("options")
                chosen = getattr(options, "timeout_seconds", None) or self.options.timeout_seconds
                timeout = chosen or mon.env_timeout
                now = time.monotonic()
                mon.kind = kind
                mon.deadline = None if timeout is None else now + timeout
                # After the exit hook no thread watches: the handshake polls, to bound the collective itself.
                polled = chosen is not None or mon.env_polled or WATCHDOG.exited
                mon.polled = timeout is not None and polled
                mon.start = now
                try:
                    result = method(self, *args, **kwargs)
                    mon.completed = self.seq
                    return result
                finally:
                    mon.start = mon.deadline = None  # a later unwatched wait must not inherit this deadline
                    mon.polled = False
                    mon.last = (kind, self.seq, time.monotonic())
                    if timeline.writer is not None:
                        timeline.writer.collective(self, kind, now, mon.last[2], args)
            finally:
                mon.last_thread, mon.thread = me, None
                mon.busy.release()

        return watched  # type: ignore[return-value]

    return decorate


def _two_threads(mon: Monitor, me: int, kind: str) -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    inside = mon.thread
    return (
        f"{kind} was called from thread {names.get(me, me)!r} while thread "
        f"{names.get(inside, inside) if inside else 'another'!r} is inside {mon.kind or 'a collective'} "
        f"(collective #{mon.seq}) of the same strategy. A strategy's collectives run one thread at a "
        "time: the ranks would pair two threads' collectives up differently. Call them from one "
        "thread, or give each thread its own strategy (MPIStrategy(comm.Dup()))."
    )


def wait(mon: Monitor, request: MPI.Request) -> None:
    """Complete ``request``, raising ``CollectiveTimeoutError`` once this collective has timed out."""
    mon.polling = True
    spins = 0
    try:
        while not request.Test():
            if mon.expired is not None:
                raise CollectiveTimeoutError(mon.expired)
            spins += 1
            if spins > 2000:  # past the fast path: stop burning a core
                time.sleep(0.0002)
                if mon.deadline is not None:
                    _unattended(mon, time.monotonic() - mon.deadline)
    finally:
        mon.polling = False


def duplicate(comm: MPI.Intracomm, timeout: float | None, what: str = "MPIStrategy()") -> MPI.Intracomm:
    """``comm.Dup()`` (collective over ``comm``), bounded: the job ends, with a message naming
    ``what``, when a rank of ``comm`` is heard to have exited, or after ``timeout`` seconds.

    Who exited is known from the strategies this process already watches (see
    :func:`announce_exit`); the wait costs nothing until the first poll finds the copy unfinished.
    """
    new, request = comm.Idup()
    ends = None if timeout is None else time.monotonic() + timeout
    members: set[int] | None = None  # world ranks of comm, worked out once a rank has left
    while not request.Test():
        time.sleep(0.001)
        if WATCHDOG.departed:
            if members is None:
                members = _world_ranks(comm)
            gone = sorted(set(WATCHDOG.departed) & members)
            if gone:
                problem = f"world rank {gone[0]} exited ({WATCHDOG.departed[gone[0]]})"
                break
        if ends is not None and time.monotonic() > ends:
            problem = f"it did not complete within its timeout of {timeout:g} s (MPISTRAT_TIMEOUT)"
            break
    else:
        return new
    abort.abort_job(
        f"{what} cannot create its communicator (MPI_Comm_dup, collective over the {comm.Get_size()} ranks "
        f"of the one it was given, called at {call_site(sys._getframe(1))}): {problem}. The job is aborted."
    )


def _world_ranks(comm: MPI.Intracomm) -> set[int]:
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return {int(r) for r in group.Translate_ranks(None, world)}
    finally:
        group.Free()
        world.Free()


def _unattended(mon: Monitor, late: float) -> None:
    """This rank's collective is ``late`` seconds past its deadline and no watchdog thread ended it."""
    if WATCHDOG.exited and late > 0:
        # Called from an exit handler that ran after mpistrat's: nothing could catch an error
        # and end the job, so end it here.
        timeout = f" of {mon.deadline - mon.start:g} s" if mon.deadline and mon.start else ""
        abort.abort_job(
            f"{_headline(mon)} did not complete within its timeout{timeout}; the missing ranks are "
            "unknown: it was called after mpistrat's exit hook, which stops the watchdog (register "
            "exit handlers that call collectives after `import mpistrat`, so they run first). "
            "The job is aborted."
        )
    if late > PATIENCE + GRACE:  # the watchdog should have answered by now; do not wait for it forever
        mon.expired = (
            f"{mon.kind} (collective #{mon.seq}) timed out; the missing ranks are unknown "
            "(the watchdog thread did not report)"
        )
        abort.abort_later(ABORT_DELAY, mon.expired)


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5, 6``: runs of three or more are ranges, so a list of most of R
    ranks stays short.

    >>> _ranks([6, 5, 0, 1, 2])
    'ranks 0-2, 5, 6'
    """
    ordered, runs = sorted(ranks), list[list[int]]()
    for r in ordered:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}-{b}" if b - a > 1 else ", ".join(map(str, range(a, b + 1))) for a, b in runs)
    return ("rank " if len(ordered) == 1 else "ranks ") + text


def _where(rank: int, answer: dict[str, Any]) -> str:
    name = f"rank {rank}" if answer["world"] == rank else f"rank {rank} (world {answer['world']})"
    if answer["waited"] is not None:
        return f"{name} is in {answer['kind']} (collective #{answer['seq']}) at {answer['site']}"
    last = answer["last"]
    done = "no collective yet" if last is None else f"last finished {last[0]} #{last[1]} {last[2]:.1f} s ago"
    return f"{name} is not in a collective ({done}); it is at {answer['site']}"


def _silent(ranks: list[int], listened: float) -> str:
    """The ranks that did not answer: slow (oversubscribed, in a long MPI call) is not gone."""
    why = "slow to answer, or killed, or blocked outside Python"
    return f"{_ranks(ranks)} did not answer within {listened:.0f} s ({why})"


def _explain(
    seq: int, kind: str, answers: dict[int, dict[str, Any]], size: int, known: set[int], listened: float
) -> tuple[str, list[int]]:
    """Who is missing from collective ``seq`` (``kind``), by the answers; ``known`` ranks wait in it too.

    Returns the explanation and the ranks waiting in the collective. A rank that did not answer
    within ``listened`` seconds is named once, with the others, not reported as gone.
    """
    waiting = sorted(
        known
        | {r for r, a in answers.items() if a["waited"] is not None and a["seq"] == seq and a["kind"] == kind}
    )
    if not waiting:
        return "no rank is waiting in it any more", []
    missing = [r for r in range(size) if r not in waiting]
    if not missing:
        return "every rank is in it now", waiting
    if any(a.get("agreed") and a["seq"] == seq and a["kind"] == kind for a in answers.values()):
        # A rank past this collective's opening handshake (an all-reduce) proves every rank entered
        # it. A rank busy inside it may answer late: MPI can hold up the watchdog's messages while
        # the main thread transfers (measured: over 1 s in a 900 MiB all_gather at 3 ranks).
        silent = [r for r in missing if r not in answers]
        done = [r for r in missing if r in answers]
        text = (
            "every rank has entered it (its opening handshake completed): a long transfer, not a missing rank"
        )
        if silent:
            text += f"; {_ranks(silent)} did not answer within {listened:.0f} s (busy inside it)"
        if done:
            text += f"; {'; '.join(_where(r, answers[r]) for r in done)} (finished it)"
        return text, waiting
    absent, silent = [r for r in missing if r in answers], [r for r in missing if r not in answers]
    lines = [_where(r, answers[r]) for r in absent] + ([_silent(silent, listened)] if silent else [])
    return (
        f"waiting for {_ranks(absent or silent)}: {'; '.join(lines)}. Waiting in it: {_ranks(waiting)}",
        waiting,
    )


def diagnose(mon: Monitor, start: float | None, grace: float = GRACE) -> tuple[str, list[int]]:
    """Ask every rank where it is, from this thread; return (who is missing, the waiting ranks).

    This rank counts as waiting. The watchdog does not call this on every waiting rank:
    one rank asks for all of them (see the module docstring).
    """
    seq, kind = mon.seq, mon.kind
    if not mon.side:
        return NO_SIDE_CHANNEL, [mon.rank]
    with WATCHDOG.lock:
        if mon not in WATCHDOG.registry:
            return FINALIZED, [mon.rank]
        qid = _query(mon)
    end = time.monotonic() + grace
    while time.monotonic() < end and len(mon.answers[qid]) < mon.size - 1 and mon.start == start:
        time.sleep(POLL / 5)
        _serve(mon)
    with WATCHDOG.lock:
        answers = mon.answers.pop(qid)
    answers[mon.rank] = mon.state()
    explanation, waiting = _explain(seq, kind, answers, mon.size, {mon.rank}, grace)
    return explanation + _records(mon, answers), waiting


# -- the side channel (every function here is called with WATCHDOG.lock held) ----------------


def _send(mon: Monitor, message: tuple[Any, ...], dest: int) -> None:
    WATCHDOG.sends.append(mon.comm.isend(message, dest=dest, tag=TAG))


def _remember(table: dict[Event, Any], event: Event, value: Any) -> None:
    table[event] = value
    while len(table) > _KEEP:
        del table[next(iter(table))]


def _query(mon: Monitor) -> int:
    """Ask every other rank where it is; their answers are filed under the returned id."""
    qid = next(WATCHDOG.queries)
    mon.answers[qid] = {}
    for r in range(mon.size):
        if r != mon.rank:
            _send(mon, ("query", qid), r)
    return qid


def _coordinate(mon: Monitor, event: Event, reporter: int | None) -> None:
    """``reporter`` (None: this rank) waits in ``event``: answer it, or diagnose the event for everyone."""
    if event in mon.results:
        told = mon.told.get(event)
        if told is None:
            told = set()
            _remember(mon.told, event, told)
        if reporter is not None and reporter not in told:  # its report crossed the result: it has one
            told.add(reporter)
            speaker = mon.results[event][1]
            _send(mon, ("result", event, _pointer(speaker), speaker), reporter)
    elif event in mon.diagnosing:
        if reporter is not None:
            mon.diagnosing[event].reporters.add(reporter)
    else:
        reporters = set() if reporter is None else {reporter}
        mon.diagnosing[event] = Diagnosis(_query(mon), time.monotonic(), reporters)


def _pointer(speaker: int) -> str:
    """What the ranks that do not print a diagnosis say instead (O(1) bytes each, not O(R))."""
    return f"rank {speaker} prints who is missing"


def _serve(mon: Monitor) -> None:
    """Answer queries, file answers and results, and take reports of events to diagnose."""
    if not mon.side:
        return
    with WATCHDOG.lock:
        if mon not in WATCHDOG.registry:
            return
        status = MPI.Status()
        while (message := mon.comm.improbe(MPI.ANY_SOURCE, TAG, status)) is not None:
            what, ref, *payload = message.recv()
            source = status.Get_source()
            if what == "query":
                _send(mon, ("answer", ref, mon.state()), source)
            elif what == "answer":
                if ref in mon.answers:
                    mon.answers[ref][source] = payload[0]
            elif what == "report":
                _coordinate(mon, tuple(ref), source)
            elif what == "result":
                _remember(mon.results, tuple(ref), (payload[0], int(payload[1])))
            elif what == "left":  # ref: the rank that exited; payload: its last collective, why, world rank
                _depart(mon, ref, payload[0], payload[1], payload[2], told_by=source)


def _depart(mon: Monitor, rank: int, last: int, why: str, world: int, told_by: int) -> None:
    """``rank`` exited after collective ``last``; the coordinator tells every other rank of the first."""
    if rank in mon.departed:
        return
    first = not mon.departed
    mon.departed[rank] = (last, why)
    WATCHDOG.departed.setdefault(world, why)
    if first and told_by == rank:  # from the rank itself: this rank is its coordinator
        for r in range(mon.size):
            if r not in (rank, mon.rank):
                _send(mon, ("left", rank, last, why, world), r)


def _coordinator(mon: Monitor) -> int:
    return 1 if mon.rank == 0 else 0


def announce_exit() -> None:
    """This process is exiting: tell each live strategy's coordinator (which tells the others).

    Ranks waiting in a collective this rank will never join then end at once, naming it,
    instead of waiting for a timeout. One message per strategy from each exiting rank and
    at most R-1 from the coordinator, so a job's normal end costs O(R) messages.
    """
    if not MPI.Is_initialized() or MPI.Is_finalized() or os.getpid() != WATCHDOG.pid:
        return  # (a forked child inherits the exit hook, not the rank: its parent goes on)
    why, world = _exit_reason(), MPI.COMM_WORLD.Get_rank()
    with WATCHDOG.lock:
        for mon in list(WATCHDOG.registry):
            if mon.side and mon.watched:
                _send(mon, ("left", mon.rank, mon.completed, why, world), _coordinator(mon))
    ends = time.monotonic() + GRACE
    while WATCHDOG.sends and time.monotonic() < ends:  # small messages: sent at once unless a peer is gone
        with WATCHDOG.lock:
            WATCHDOG.sends[:] = [r for r in WATCHDOG.sends if not r.Test()]
        time.sleep(POLL / 20)


def _exit_reason() -> str:
    error = getattr(sys, "last_value", None)  # an uncaught exception ended the program
    if error is not None:
        return f"an uncaught {type(error).__name__}"
    return "sys.exit or the end of its program"


def _advance(mon: Monitor) -> None:
    """Finish the diagnoses whose answers are in (or overdue), and send out their results."""
    if not mon.diagnosing:
        return
    now = time.monotonic()
    with WATCHDOG.lock:
        if mon not in WATCHDOG.registry:
            return
        for event, job in list(mon.diagnosing.items()):
            answers = mon.answers[job.qid]
            if len(answers) < mon.size - 1 and now < job.began + LISTEN:
                continue
            del mon.diagnosing[event], mon.answers[job.qid]
            answers[mon.rank] = mon.state()
            silent = {r for r in job.reporters if r not in answers}  # reported it, then stopped answering
            explanation, waiting = _explain(event[0], event[1], answers, mon.size, silent, now - job.began)
            if mon.rank > 0:  # reports reach rank r only after ranks 0 to r-1 did not reply
                passed = "rank 0" if mon.rank == 1 else f"ranks 0 to {mon.rank - 1}"
                explanation += f" ({passed} did not answer as the watchdog's coordinator; "
                explanation += f"rank {mon.rank} stood in)"
            # The diagnosis (O(R) text with every rank's flight record) goes to one rank, the one
            # that speaks for the waiting ones; the others get a pointer to it. Sent to each, it
            # would cost O(R^2) bytes.
            full = explanation + _records(mon, answers)
            speaker = min(waiting) if waiting else mon.rank
            _remember(mon.results, event, (full if mon.rank == speaker else _pointer(speaker), speaker))
            recipients = (job.reporters | set(waiting)) - {mon.rank}
            _remember(mon.told, event, set(recipients))
            for r in sorted(recipients):
                _send(mon, ("result", event, full if r == speaker else _pointer(speaker), speaker), r)


def _result(mon: Monitor, event: Event, now: float) -> Result | None:
    """The diagnosis of ``event`` (this rank waits in it) if it is here; else see that one is on its way."""
    if not mon.side:
        return NO_SIDE_CHANNEL, -1
    with WATCHDOG.lock:
        if mon not in WATCHDOG.registry:
            return FINALIZED, -1
        if event in mon.results:
            return mon.results[event]
        if event in mon.diagnosing:
            return None
        reported = mon.reported.get(event)
        if reported is not None and now - reported[1] < WAIT:
            return None
        coordinator = 0 if reported is None else reported[0] + 1
        if coordinator < mon.rank:
            _send(mon, ("report", event), coordinator)
            _remember(mon.reported, event, (coordinator, now))
        else:  # rank 0, or every rank below this one failed to reply: diagnose it here
            _coordinate(mon, event, None)
        return None


# -- the watchdog thread ------------------------------------------------------------


def _tend(mon: Monitor) -> None:
    """Act on this rank's stall or timeout once its diagnosis is here (asking for it until then)."""
    start = mon.start
    if start is None:
        return
    seq, kind = mon.seq, mon.kind
    if mon.start != start:
        return  # a new collective began while we read
    if mon.departed and mon.handled != start:
        gone = sorted((r, last, why) for r, (last, why) in mon.departed.items() if last < seq)
        if gone:  # it exited before this collective: it will never join it
            mon.handled = start
            rank, last, why = gone[0]
            _end(
                mon,
                start,
                f"{_headline(mon)} cannot complete: rank {rank} exited after collective #{last} ({why})",
            )
            return
    now = time.monotonic()
    if mon.deadline is not None and now >= mon.deadline:
        if mon.handled == start:
            return
        result = _result(mon, (seq, kind, "timeout"), now)
        if result is None and now >= mon.deadline + PATIENCE:
            result = (
                f"which ranks are missing is unknown (no diagnosis came within {PATIENCE:g} s: "
                "the ranks asked to make one did not answer)",
                -1,
            )
        if result is not None:
            mon.handled = start
            _time_out(mon, start, mon.deadline - start, result[0])
        return
    event = (seq, kind, "stall")
    if mon.stall_after is None or mon.warned == start:
        return
    if now - start < mon.stall_after and event not in mon.results:
        return  # not stalled here yet, and no diagnosis came from another rank
    if mon.noticed is None or mon.noticed[0] != start:
        mon.noticed = (start, now)
    result = _result(mon, event, now)
    if result is not None:
        mon.warned = start
        # A result sent before this rank's own timer came: some rank has waited stall_after.
        _warn(mon, start, max(mon.noticed[1] - start, mon.stall_after), result)


def _headline(mon: Monitor) -> str:
    frame = sys._current_frames().get(mon.thread) if mon.thread else None
    site = call_site(frame) if frame is not None else "<unknown>"
    return f"{mon.kind} (collective #{mon.seq}, called at {site})"


def _warn(mon: Monitor, start: float, waited: float, result: Result) -> None:
    (explanation, records), speaker = flight.split(result[0]), result[1]
    if mon.start != start or speaker not in (-1, mon.rank):
        return  # it completed meanwhile, or the lowest waiting rank speaks for all of them
    late = stragglers.note(getattr(mon.owner(), "stragglers", None))
    logger.warning(
        f"{_headline(mon)} has waited {waited:.0f} s: {explanation}. "
        + (f"Before it, {late}. " if late else "")
        + "(MPISTRAT_STALL_WARNING_SECONDS sets when this warning comes; MPISTRAT_TIMEOUT ends the job.)"
        + records,
        extra=ANY_RANK,
    )


def _time_out(mon: Monitor, start: float, timeout: float, explanation: str) -> None:
    default = "" if mon.polled else " (MPISTRAT_TIMEOUT's default; set it to change this, 0 to disable)"
    problem = f"{_headline(mon)} did not complete within its timeout of {timeout:g} s{default}"
    _end(mon, start, f"{problem}: {explanation}")


def _end(mon: Monitor, start: float, problem: str) -> None:
    """End the job: this collective cannot complete (raise it first where the main thread polls)."""
    if mon.start != start:
        return
    problem, records = flight.split(problem)  # the ranks' flight records go last
    message = (
        f"{problem}. The job is aborted: a collective left half-done leaves the communicator unusable."
        f"{records}"
    )
    if mon.polling:
        mon.expired = message  # the main thread raises CollectiveTimeoutError with it
        abort.abort_later(ABORT_DELAY, f"{mon.kind} (collective #{mon.seq}) could not complete")
    else:
        abort.abort_job(message)
