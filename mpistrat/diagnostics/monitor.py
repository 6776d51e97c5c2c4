"""The hot-path bookkeeping: what one strategy's collectives are doing, marked on every call.

A :class:`Monitor` is a few attributes the collective's own thread writes as it enters
and leaves a collective (:func:`collective`, through :meth:`Monitor.enter` and
:meth:`Monitor.leave`, their one writer) and the handshake writes once every rank has
entered (``agreed``); the watchdog thread (``watchdog.py``) reads them a few times a second
and writes back only what it decided (``expired``, and its own ``warned`` and ``handled``).
Its one dependency is the ``Collectives`` object it watches (held weakly), for
the sequence number and the flight record. It sends no messages: asking other ranks is the
side channel's (``side_channel.py``), saying what was found is ``diagnosis.py``'s.

>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> Collectives(MPI.COMM_SELF).monitor.watched  # one rank cannot stall
False
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from mpi4py import MPI

from mpistrat.diagnostics import timeline
from mpistrat.diagnostics.callsite import call_site
from mpistrat.errors import ContextError

if TYPE_CHECKING:
    from mpistrat.diagnostics.deaths import Watch
    from mpistrat.diagnostics.flight import Flight

__all__ = [
    "Channel",
    "Diagnosis",
    "Event",
    "Monitor",
    "PythonMarks",
    "PythonMonitor",
    "Result",
    "Watched",
    "collective",
    "exited",
]

F = TypeVar("F", bound=Callable[..., Any])

# mpistrat's exit hook ran (set by ``Watchdog.shutdown``): no thread watches any more, so a
# collective's handshake polls, to bound the collective itself. A module attribute, as
# ``timeline.writer``: the decorator reads it once per call.
exited = False
_monotonic = time.monotonic  # read per call: a global, not a module attribute


Event = tuple[int, str, str]  # (seq, kind, "stall" | "timeout"): one event of one collective
Result = tuple[str, int]  # (who is missing and where, the rank that prints it: -1 each rank)


@dataclasses.dataclass
class Diagnosis:
    """An event this rank diagnoses: its query, when to stop waiting, who to tell besides the waiting."""

    qid: int
    began: float
    reporters: set[int]


class Channel:
    """One strategy's side-channel state (``Monitor.side``), touched with ``SideChannel.lock`` held:
    what its side channel (``side_channel.py``) has asked, heard and told."""

    def __init__(self) -> None:
        self.answers: dict[int, dict[int, dict[str, Any]]] = {}  # query id -> rank -> its state
        self.diagnosing: dict[Event, Diagnosis] = {}  # events this rank diagnoses for everyone
        self.results: dict[Event, Result] = {}  # made here or sent by the rank that diagnosed
        self.reported: dict[Event, tuple[int, float]] = {}  # (rank reported to, when)
        self.told: dict[Event, set[int]] = {}  # the ranks a result was sent to (each gets it once)
        self.departed: dict[int, tuple[int, str]] = {}  # rank -> (its last collective, why) after it exited
        # rank -> (when this rank heard, what was seen, its world rank): a rank whose process ended
        # before it said it leaves (diagnostics/deaths.py)
        self.deaths: dict[int, tuple[float, str, int]] = {}
        # rank -> its record of collectives left unchecked (MPISTRAT_CHECK=step) when it exited, flat
        # (seq, kind, code, ...): rank 0 compares them once every rank has left (farewell.py)
        self.unchecked: dict[int, list[Any]] = {}


class Watched(Protocol):
    """What a monitor reads of the collectives it watches (``collectives.Collectives`` is one)."""

    comm: MPI.Intracomm
    rank: int
    size: int
    seq: int  # the number of the collective under way, or of the last one
    flight: Flight  # their flight record, which a rank's state shows


class PythonMarks:
    """What one strategy's collectives are doing, marked on every call (the fields of a
    :class:`Monitor` its collectives' thread writes): the reference twin of the compiled
    ``native_step.Marks``, which the compiled closing writes (``collectives/native_step.c``).

    >>> marks = PythonMarks()
    >>> marks.kind, marks.start, marks.completed, marks.handshakes
    ('', None, 0, 0)
    """

    __slots__ = (
        "agreed",
        "completed",
        "deadline",
        "handshakes",
        "kind",
        "last",
        "last_thread",
        "polled",
        "start",
        "thread",
    )

    def __init__(self) -> None:
        self.kind = ""
        self.start: float | None = None  # monotonic time the current collective began; None: idle
        self.deadline: float | None = None
        self.polled = False  # the current collective's timeout was chosen: its handshake polls, to raise
        self.thread: int | None = None  # the thread inside a collective
        self.last_thread: int | None = None  # the thread of the last collective (where the program is)
        self.last: tuple[str, int, float] | None = None  # (kind, seq, end time) of the last collective
        self.agreed: float | None = None  # start of the collective whose opening handshake completed
        self.completed = 0  # the last collective this rank completed (not one it left by an error)
        self.handshakes = 0  # handshakes so far (a preemption check runs one when none came)


class Monitor:
    """What one strategy's collectives are doing: written by their thread, read by the watchdog's.

    Its marks (``kind`` ... ``handshakes``) are a base's, one of two twins: :class:`PythonMonitor`
    holds them in :class:`PythonMarks`, ``step_check.CompiledMonitor`` in the compiled
    ``native_step.Marks`` that the compiled closing writes, which ``Collectives`` makes where its
    step check (``MPISTRAT_CHECK=step``) runs its compiled twin.

    Fields by who writes them (the watchdog thread reads all of them):

    * set once, when the strategy is created (``watchdog.watch``): ``owner``, ``comm``,
      ``rank``, ``size``, ``env_timeout``, ``env_polled``, ``stall_after``, ``side``, ``hosts``,
      ``deaths``;
      ``watched`` is cleared when the strategy is finalized or collected;
    * the collective's thread, on every call: ``thread`` and ``last_thread`` (:func:`collective`),
      ``kind``, ``start``, ``deadline``, ``polled`` (:meth:`enter`), ``last``, ``completed``
      (:meth:`leave`), ``agreed`` and ``handshakes`` (the handshake); ``polling`` while it waits in
      ``watchdog.wait``;
    * the watchdog thread, for the collective's thread to raise: ``expired``, ``lost``;
    * the watchdog thread, for itself (one stall or timeout acted on once): ``warned``,
      ``handled``.
    """

    if TYPE_CHECKING:  # the marks, a twin's (PythonMarks says what each holds)
        kind: str
        start: float | None
        deadline: float | None
        polled: bool
        thread: int | None
        last_thread: int | None
        last: tuple[str, int, float] | None
        agreed: float | None
        completed: int
        handshakes: int

    def __init__(self, collectives: Watched):
        super().__init__()  # the twin's marks
        # -- set at creation
        self.owner: weakref.ref[Watched] = weakref.ref(collectives)
        self.comm: MPI.Intracomm = collectives.comm
        self.rank, self.size = collectives.rank, collectives.size
        self.watched = self.size > 1
        self.env_timeout: float | None = None
        self.env_polled = False  # MPISTRAT_TIMEOUT is set (not the default): polled, so it raises
        self.stall_after: float | None = None
        self.side: Channel | None = None  # this strategy's side-channel state; None: no side channel
        self.hosts: tuple[str, ...] = ()  # every rank's host, where they are several (named in diagnoses)
        self.deaths: Watch | None = None  # the watch of another rank's process on this machine (None: none)
        # -- written by the collective's thread, read by the watchdog thread (and the marks)
        self.busy = threading.Lock()  # held by the thread inside a collective: one thread at a time
        self.polling = False  # the collective's thread waits in watchdog.wait(), so it can raise
        # -- written by the watchdog thread, read by the collective's thread
        self.expired: str | None = None  # the timeout message (watchdog.wait raises it)
        self.lost: int | None = None  # with it, the world rank whose death it waits for
        # -- the watchdog thread's own
        self.warned: float | None = None  # start of the collective whose stall was warned of
        self.handled: float | None = None  # start of the collective whose timeout or loss was handled

    def enter(self, kind: str, chosen: float | None) -> float:
        """Mark this thread inside collective ``kind`` (the one writer of these marks, with
        :meth:`leave`), its timeout ``chosen`` in the options (None: the environment's, if any, not
        polled); returns its start (monotonic)."""
        now = _monotonic()
        timeout = chosen or self.env_timeout
        self.kind = kind
        self.deadline = None if timeout is None else now + timeout
        # After the exit hook no thread watches: the handshake polls, to bound the collective itself.
        self.polled = timeout is not None and (chosen is not None or self.env_polled or exited)
        self.start = now  # last: the watchdog reads a collective's marks once its start is set
        return now

    def leave(self, kind: str, seq: int, completed: bool) -> float:
        """Mark collective #``seq`` of ``kind`` left (``completed``: not by an error); returns its end."""
        if completed:
            self.completed = seq
        self.start = self.deadline = None  # a later unwatched wait must not inherit this deadline
        self.polled = False
        self.last = (kind, seq, ended := _monotonic())
        return ended

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
            "entries": _entries(self),
        }


class PythonMonitor(Monitor, PythonMarks):
    """A monitor over the Python twin of its marks."""


def _flight(mon: Monitor, now: float, start: float | None) -> str | None:
    owner = mon.owner()
    if owner is None or not hasattr(owner, "flight"):
        return None
    busy = start is not None
    return owner.flight.describe(now, busy=busy, agreed=busy and mon.agreed == start)


def _entries(mon: Monitor) -> list[tuple[int, str, int]]:
    """The flight record's entries as ``(seq, kind, fingerprint)``: what ranks compare to find where
    they first differed (``collectives/failure.py``)."""
    owner = mon.owner()
    if owner is None or not hasattr(owner, "flight"):
        return []
    return [(e[0], e[1], e[2]) for e in owner.flight.entries()]


_get_ident = threading.get_ident


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
            me = _get_ident()
            if not mon.busy.acquire(False):  # positional: every collective's path
                if mon.thread != me:
                    raise ContextError(two_threads(mon, me, default_kind))
                return method(self, *args, **kwargs)  # a helper inside this thread's collective: part of it
            mon.thread = me
            try:
                if not (mon.watched or timeline.writer is not None):
                    return method(self, *args, **kwargs)
                kind = args[kind_at] if 0 <= kind_at < len(args) else kwargs.get("kind", default_kind)
                options = args[options_at] if 0 <= options_at < len(args) else kwargs.get("options")
                chosen = getattr(options, "timeout_seconds", None) or self.options.timeout_seconds
                began = mon.enter(kind, chosen)
                completed = False
                try:
                    result = method(self, *args, **kwargs)
                    completed = True
                    return result
                finally:
                    ended = mon.leave(kind, self.seq, completed)
                    if timeline.writer is not None:
                        timeline.writer.collective(self, kind, began, ended, args)
            except MPI.Exception as exc:  # the private communicators return MPI's errors (ERRORS_RETURN)
                self.failures += 1
                kind = args[kind_at] if 0 <= kind_at < len(args) else kwargs.get("kind", default_kind)
                raise self.failed_in_mpi(exc, kind) from exc
            except BaseException:
                self.failures += 1  # strategy.run then knows its error came out of a collective
                raise
            finally:
                mon.last_thread, mon.thread = me, None
                mon.busy.release()

        return watched  # type: ignore[return-value]

    return decorate


def two_threads(mon: Monitor, me: int, kind: str) -> str:
    """The error of a second thread calling ``kind`` while another is inside a collective."""
    names = {t.ident: t.name for t in threading.enumerate()}
    inside = mon.thread
    return (
        f"{kind} was called from thread {names.get(me, me)!r} while thread "
        f"{names.get(inside, inside) if inside else 'another'!r} is inside {mon.kind or 'a collective'} "
        f"(collective #{mon.seq}) of the same strategy. A strategy's collectives run one thread at a "
        "time: the ranks would pair two threads' collectives up differently. Call them from one "
        "thread, or give each thread its own strategy (MPIStrategy(comm.Dup()))."
    )
