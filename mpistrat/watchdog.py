"""Watch collectives: warn when one stalls, end the job when one times out, and say who is missing.

The main thread marks entering and leaving a collective on the strategy's :class:`Monitor`
(a few attribute writes, see :func:`collective`). One daemon thread per process looks at
every watched strategy a few times a second. mpi4py releases the GIL inside blocking MPI
calls, so it runs while the main thread waits.

* After ``MPISTRAT_STALL_WARNING_SECONDS`` (default 60) in one collective it logs a
  warning naming the ranks that have not arrived, and where they are instead.
* At ``timeout_seconds`` (``CommunicationOptions`` or ``MPISTRAT_TIMEOUT``) it builds the
  same diagnosis; if the main thread is waiting in a request it polls (the opening
  handshake), that thread raises :class:`~mpistrat.errors.CollectiveTimeoutError`; either
  way the job then ends with ``MPI_Abort``, since a half-done collective leaves the
  communicator unusable.

Who is missing is asked over a side channel: point-to-point messages with a reserved
tag on the strategy's private communicator. MPI never matches point-to-point messages
with collectives, so this traffic cannot disturb the collective in progress, and no
second communicator is needed. Every rank's watchdog answers a query with where its
main thread is (inside which collective, or at which line of the program); a rank that
does not answer has exited, was killed, or is stuck outside Python. This needs MPI
thread level ``MULTIPLE`` (mpi4py's default); below it there is no side channel and the
messages say the missing ranks are unknown.

>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> Collectives(MPI.COMM_SELF).monitor.watched  # one rank cannot stall
False
"""

from __future__ import annotations

import atexit
import functools
import inspect
import itertools
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from mpi4py import MPI

from mpistrat import abort
from mpistrat.errors import CollectiveTimeoutError, InvalidArgumentError
from mpistrat.log import ANY_RANK, logger

__all__ = ["Monitor", "call_site", "collective", "unwatch", "wait", "watch"]

TAG = 0x6D73  # reserved on the private communicator for watchdog queries and answers
POLL = 0.1  # seconds between the watchdog's looks (and the latency of its answers)
GRACE = 1.0  # seconds to wait for answers to a query
ABORT_DELAY = 5.0  # seconds between a raised CollectiveTimeoutError and MPI_Abort
STALL_DEFAULT = 60.0

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_registry: list[Monitor] = []
_lock = threading.Lock()  # guards the registry and every side-channel MPI call
_stop = threading.Event()
_thread: threading.Thread | None = None
_queries = itertools.count(1)
_sends: list[MPI.Request] = []  # side-channel sends in flight (kept alive until complete)

F = TypeVar("F", bound=Callable[..., Any])


def seconds_from_env(name: str, default: float | None) -> float | None:
    """A positive number of seconds from the environment; ``0``/``off``/``none`` disables (None).

    >>> seconds_from_env("MPISTRAT_NOT_SET", 60.0)
    60.0
    """
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("off", "none", "no", "false"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if math.isnan(value) or value < 0:
        raise InvalidArgumentError(
            f"{name} must be a number of seconds > 0, or 0/off to disable; got {os.environ[name]!r}"
        )
    return None if value == 0 or math.isinf(value) else value


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
        self.thread: int | None = None
        self.last: tuple[str, int, float] | None = None  # (kind, seq, end time) of the last collective
        self.polling = False  # the main thread waits in wait(), so it can raise
        self.expired: str | None = None  # set by the watchdog: the timeout message
        self.warned: float | None = None
        self.handled: float | None = None
        self.env_timeout: float | None = None
        self.stall_after: float | None = None
        self.side = False
        self.answers: dict[int, dict[int, dict[str, Any]]] = {}

    @property
    def seq(self) -> int:
        owner = self.owner()
        return -1 if owner is None else owner.seq

    def state(self) -> dict[str, Any]:
        """Where this rank is now: inside which collective, or where its program is."""
        now, start = time.monotonic(), self.start
        thread = self.thread or threading.main_thread().ident
        frame = sys._current_frames().get(thread)
        return {
            "world": MPI.COMM_WORLD.Get_rank(),
            "seq": self.seq,
            "kind": self.kind if start is not None else None,
            "waited": None if start is None else now - start,
            "last": None if self.last is None else (self.last[0], self.last[1], now - self.last[2]),
            "site": call_site(frame) if frame is not None else "<no Python frame>",
        }


def watch(collectives: Any) -> Monitor:
    """A monitor for ``collectives``; registered with the watchdog thread when there are 2+ ranks.

    Reads ``MPISTRAT_TIMEOUT`` and ``MPISTRAT_STALL_WARNING_SECONDS`` now (when the strategy is created).
    """
    mon = Monitor(collectives)
    mon.env_timeout = seconds_from_env("MPISTRAT_TIMEOUT", None)
    mon.stall_after = seconds_from_env("MPISTRAT_STALL_WARNING_SECONDS", STALL_DEFAULT)
    if mon.watched:
        mon.side = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        with _lock:
            _registry.append(mon)
        _start()
    return mon


def unwatch(mon: Monitor) -> None:
    """Stop watching (before the communicator is freed); takes the lock the watchdog's MPI calls hold."""
    with _lock:
        if mon in _registry:
            _registry.remove(mon)
    mon.watched = False


def collective(default_kind: str) -> Callable[[F], F]:
    """Decorate a ``Collectives`` method: mark this strategy busy in it while it runs.

    The method's ``kind`` and ``options`` arguments (when it has them) name the
    collective and may set its timeout; a collective called inside another one
    (a helper) belongs to the outer one.
    """

    def decorate(method: F) -> F:
        names = list(inspect.signature(method).parameters)[1:]
        kind_at = names.index("kind") if "kind" in names else -1
        options_at = names.index("options") if "options" in names else -1

        @functools.wraps(method)
        def watched(self: Any, *args: Any, **kwargs: Any) -> Any:
            mon: Monitor = self.monitor
            if mon.start is not None or not mon.watched:
                return method(self, *args, **kwargs)
            kind = args[kind_at] if 0 <= kind_at < len(args) else kwargs.get("kind", default_kind)
            options = args[options_at] if 0 <= options_at < len(args) else kwargs.get("options")
            timeout = (
                getattr(options, "timeout_seconds", None) or self.options.timeout_seconds or mon.env_timeout
            )
            now = time.monotonic()
            mon.kind, mon.thread = kind, threading.get_ident()
            mon.deadline = None if timeout is None else now + timeout
            mon.start = now
            try:
                return method(self, *args, **kwargs)
            finally:
                mon.start = None
                mon.last = (kind, self.seq, time.monotonic())

        return watched  # type: ignore[return-value]

    return decorate


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
                if mon.deadline is not None and time.monotonic() > mon.deadline + 4 * GRACE + 2 * POLL:
                    # The watchdog should have answered by now; do not wait for it forever.
                    mon.expired = (
                        f"{mon.kind} (collective #{mon.seq}) timed out; the missing ranks are unknown"
                    )
                    abort.abort_later(ABORT_DELAY, mon.expired)
    finally:
        mon.polling = False


# -- where the program is ------------------------------------------------------------


def call_site(frame: Any = None) -> str:
    """The innermost place outside mpistrat on a stack, as ``file:line in function``.

    >>> call_site().endswith("in <module>")
    True
    """
    f = frame if frame is not None else sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE):
        f = f.f_back
    if f is None:
        return "<inside mpistrat>"
    path = f.f_code.co_filename
    try:
        relative = os.path.relpath(path)
        path = relative if not relative.startswith("..") else path
    except ValueError:
        pass
    return f"{path}:{f.f_lineno} in {f.f_code.co_name}"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def _where(rank: int, answer: dict[str, Any] | None, mon: Monitor) -> str:
    name = (
        f"rank {rank}"
        if answer is None or answer["world"] == rank
        else f"rank {rank} (world {answer['world']})"
    )
    if answer is None:
        return f"{name} did not answer (it exited, was killed, or is blocked outside Python)"
    if answer["waited"] is not None:
        return f"{name} is in {answer['kind']} (collective #{answer['seq']}) at {answer['site']}"
    last = answer["last"]
    done = "no collective yet" if last is None else f"last finished {last[0]} #{last[1]} {last[2]:.1f} s ago"
    return f"{name} is not in a collective ({done}); it is at {answer['site']}"


def diagnose(mon: Monitor, start: float | None, grace: float = GRACE) -> tuple[str, list[int]]:
    """Ask every rank where it is; return (an explanation of who is missing, the waiting ranks)."""
    seq, kind = mon.seq, mon.kind
    if not mon.side:
        return "which ranks are missing is unknown (MPI thread level is below MULTIPLE: no side channel)", []
    qid = next(_queries)
    mon.answers[qid] = {}
    with _lock:
        if mon not in _registry:
            return "which ranks are missing is unknown (the strategy was finalized)", []
        for r in range(mon.size):
            if r != mon.rank:
                _sends.append(mon.comm.isend(("query", qid), dest=r, tag=TAG))
    end = time.monotonic() + grace
    while time.monotonic() < end and len(mon.answers[qid]) < mon.size - 1 and mon.start == start:
        time.sleep(POLL / 5)
        _serve(mon)
    answers = mon.answers.pop(qid)
    waiting = [mon.rank] + [
        r for r, a in answers.items() if a["waited"] is not None and a["seq"] == seq and a["kind"] == kind
    ]
    missing = [r for r in range(mon.size) if r not in waiting]
    if not missing:
        return "every rank is in it now", sorted(waiting)
    lines = "; ".join(_where(r, answers.get(r), mon) for r in missing)
    return f"waiting for {_ranks(missing)}: {lines}. Waiting in it: {_ranks(waiting)}", sorted(waiting)


# -- the watchdog thread ------------------------------------------------------------


def _start() -> None:
    global _thread
    if _thread is not None and _thread.is_alive():
        return
    _stop.clear()
    _thread = threading.Thread(target=_run, name="mpistrat-watchdog", daemon=True)
    _thread.start()
    atexit.register(_shutdown)


def _shutdown() -> None:
    """Stop the thread before MPI is finalized (atexit runs before mpi4py finalizes MPI)."""
    _stop.set()
    if _thread is not None and _thread is not threading.current_thread():
        _thread.join(timeout=2 * POLL + GRACE)


def _run() -> None:
    failed: set[int] = set()
    while not _stop.wait(POLL):
        if MPI.Is_finalized():
            return
        with _lock:
            monitors = list(_registry)
        for mon in monitors:
            try:
                _serve(mon)
                _tend(mon)
            except Exception:  # the watchdog must never take the job down itself
                if id(mon) not in failed:
                    failed.add(id(mon))
                    logger.exception(
                        "the collective watchdog failed; stall diagnosis is off for this strategy"
                    )
        with _lock:
            _sends[:] = [r for r in _sends if not r.Test()]


def _serve(mon: Monitor) -> None:
    """Answer queries from other ranks and file answers to ours."""
    if not mon.side:
        return
    with _lock:
        if mon not in _registry:
            return
        status = MPI.Status()
        while (message := mon.comm.improbe(MPI.ANY_SOURCE, TAG, status)) is not None:
            what, qid, *payload = message.recv()
            if what == "query":
                answer = ("answer", qid, mon.state())
                _sends.append(mon.comm.isend(answer, dest=status.Get_source(), tag=TAG))
            elif qid in mon.answers:
                mon.answers[qid][status.Get_source()] = payload[0]


def _tend(mon: Monitor) -> None:
    start = mon.start
    if start is None:
        return
    now = time.monotonic()
    if mon.deadline is not None and now >= mon.deadline and mon.handled != start:
        mon.handled = start
        _time_out(mon, start, mon.deadline - start)
    elif mon.stall_after is not None and now - start >= mon.stall_after and mon.warned != start:
        mon.warned = start
        _warn(mon, start, now - start)


def _headline(mon: Monitor) -> str:
    frame = sys._current_frames().get(mon.thread) if mon.thread else None
    site = call_site(frame) if frame is not None else "<unknown>"
    return f"{mon.kind} (collective #{mon.seq}, called at {site})"


def _warn(mon: Monitor, start: float, waited: float) -> None:
    headline = _headline(mon)
    explanation, waiting = diagnose(mon, start)
    if mon.start != start:
        return  # it completed while we asked
    if waiting and mon.rank != min(waiting):
        return  # the lowest waiting rank speaks for all of them
    logger.warning(
        f"{headline} has waited {waited:.0f} s: {explanation}. "
        "(MPISTRAT_STALL_WARNING_SECONDS sets when this warning comes; MPISTRAT_TIMEOUT ends the job.)",
        extra=ANY_RANK,
    )


def _time_out(mon: Monitor, start: float, timeout: float) -> None:
    headline = _headline(mon)
    explanation, _ = diagnose(mon, start)
    if mon.start != start:
        return
    message = (
        f"{headline} did not complete within its timeout of {timeout:g} s: "
        f"{explanation}. The job is aborted: a timed-out collective leaves the communicator unusable."
    )
    if mon.polling:
        mon.expired = message  # the main thread raises CollectiveTimeoutError with it
        abort.abort_later(ABORT_DELAY, f"{mon.kind} (collective #{mon.seq}) timed out")
    else:
        abort.abort_job(message)
