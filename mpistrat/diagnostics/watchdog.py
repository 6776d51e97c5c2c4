"""The watchdog thread: warn when a collective stalls, end the job when one times out.

The collectives mark entering and leaving on their strategy's :class:`Monitor` (a few
attribute writes, see :func:`collective` in ``monitor.py``). One daemon thread per process,
:data:`WATCHDOG`, looks at every watched strategy a few times a second: it serves the side
channel (``side_channel.py``: who is missing), and acts on what it learns (the texts are
``diagnosis.py``'s). mpi4py releases the GIL inside blocking MPI calls, so it runs while the
main thread waits.

* After ``MPISTRAT_STALL_WARNING_SECONDS`` (default 60) in one collective, the lowest
  waiting rank logs one warning for all of them, naming the ranks that have not arrived
  and where they are instead.
* At ``timeout_seconds`` (``CommunicationOptions`` or ``MPISTRAT_TIMEOUT``) every waiting
  rank gets the same diagnosis; if the main thread is waiting in a request it polls (the
  opening handshake, :func:`wait`), that thread raises
  :class:`~mpistrat.errors.CollectiveTimeoutError`; either way the job then ends with
  ``MPI_Abort``, since a half-done collective leaves the communicator unusable. A timeout
  whose diagnosis has not come ``PATIENCE`` seconds after the deadline is handled with an
  explanation that says so.
* A rank heard to have exited before the collective (it said so at exit) ends the
  collective at once, naming it.
* A rank whose process ended without saying so (seen by the rank on its machine that watches
  it, ``deaths.py``) ends every collective that waits for it: at once one begun after the death
  was heard, ``DEATH_GRACE`` seconds after it one begun before (which the dead rank may have
  joined). The job ends with status 76 (``PEER_FAILED_EXIT``), each waiting rank naming the
  dead one and its own optimizer step.

Also here: the strategies' lifecycle with the thread (:func:`watch`,
:func:`release`), the bounded duplication of a strategy's communicator (:func:`duplicate`)
and the exit hook (``Watchdog.shutdown``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable

from mpi4py import MPI

from mpistrat import config
from mpistrat.diagnostics import abort, diagnosis, farewell, monitor
from mpistrat.diagnostics.callsite import call_site
from mpistrat.diagnostics.monitor import Channel, Monitor, Watched, collective
from mpistrat.diagnostics.side_channel import GRACE, PATIENCE, POLL, SideChannel
from mpistrat.errors import PEER_FAILED_EXIT, CollectiveTimeoutError, PeerFailedError
from mpistrat.log import ANY_RANK, logger

__all__ = [
    "WATCHDOG",
    "Monitor",
    "Watchdog",
    "collective",
    "duplicate",
    "release",
    "wait",
    "watch",
]

ABORT_DELAY = 5.0  # seconds between a raised CollectiveTimeoutError and MPI_Abort
DEATH_GRACE = 1.0  # seconds a collective begun before a rank's death was heard may still complete


class Watchdog(SideChannel):
    """The process's watchdog: its thread, the strategies it watches, and its end of the side channel.

    One per process (:data:`WATCHDOG`); the module's functions use it. Its thread starts with
    the first strategy of 2+ ranks and stops at exit, after this rank says it leaves.
    """

    def __init__(self) -> None:
        super().__init__()
        self.doomed: list[tuple[Monitor, MPI.Intracomm, Callable[[], None] | None]] = []  # to free
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            return
        self.stop.clear()
        self.thread = threading.Thread(target=self.run, name="mpistrat-watchdog", daemon=True)
        self.thread.start()

    def shutdown(self) -> None:
        """Stop the thread, then say this rank leaves and read what is still sent to it
        (``farewell.leave``), before MPI is finalized (atexit runs before mpi4py finalizes MPI).

        Run by ``abort``'s exit hook, registered with ``import mpistrat``, so it runs after the
        ``atexit`` handlers a program registers after that import (even before its first strategy):
        their collectives are still watched, and a rank that skips one is named. A collective after
        this hook is bounded by its timeout alone.
        """
        monitor.exited = True
        self.stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * POLL + GRACE)
        if os.getpid() != self.pid:
            return  # a forked child inherits this hook, not the rank: no MPI call from it
        with contextlib.suppress(Exception):  # a peer that is gone already: nothing to tell it
            gc.collect()  # strategies the program dropped go now, on every rank alike
            self.reap(block=True)
            farewell.leave(self)

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
                self.serve(mon)
                self.notice(mon)
                self.advance(mon)
                self.tend(mon)
            except Exception as exc:  # the watchdog must never take the job down itself
                from mpistrat.diagnostics import ulfm  # an error's path: not every job's

                if ulfm.is_peer_failure(exc, mon.comm):
                    continue  # a rank died: the collectives' own thread raises it and recovers
                if mon not in failed:
                    failed.add(mon)
                    logger.exception(
                        "the collective watchdog failed; stall diagnosis is off for this strategy"
                    )
        self.forget_sent()

    def notice(self, mon: Monitor) -> None:
        """The rank this one watches on its machine (``deaths.py``): tell every rank if its process
        ended before it said it leaves."""
        watch, side = mon.deaths, mon.side
        if watch is None or watch.seen or side is None or not watch.ended():
            return
        watch.seen = True
        with self.lock:
            if mon not in self.registry:
                return
            from mpistrat.diagnostics import deaths  # loaded already: it made the watch

            world = deaths.world_rank(mon.comm, watch.rank)
            seen = f"its process (pid {watch.pid}) ended without saying it leaves"
            self.died(mon, side, watch.rank, seen, world, tell=True)

    def tend(self, mon: Monitor) -> None:
        """Act on this rank's stall or timeout once its diagnosis is here (asking for it until then)."""
        start = mon.start
        if start is None:
            return
        seq, kind, side = mon.seq, mon.kind, mon.side
        if mon.start != start:
            return  # a new collective began while we read
        if side is not None and side.deaths and mon.handled != start:
            now = time.monotonic()
            dead = sorted(
                (r, why, world) for r, (heard, why, world) in side.deaths.items()
                if start >= heard or now >= heard + DEATH_GRACE
            )  # fmt: skip
            if dead:  # it will never join this collective
                mon.handled = start
                _end(mon, start, diagnosis.died(mon, *dead[0]), lost=dead[0][2])
                return
        if side is not None and side.departed and mon.handled != start:
            gone = sorted((r, last, why) for r, (last, why) in side.departed.items() if last < seq)
            if gone:  # it exited before this collective: it will never join it
                mon.handled = start
                rank, last, why = gone[0]
                _end(mon, start, diagnosis.departed(mon, rank, last, why))
                return
        now = time.monotonic()
        if mon.deadline is not None and now >= mon.deadline:
            if mon.handled == start:
                return
            result = self.result(mon, (seq, kind, "timeout"), now)
            if result is None and now >= mon.deadline + PATIENCE:
                result = diagnosis.undiagnosed(PATIENCE), -1
            if result is not None:
                mon.handled = start
                _end(mon, start, diagnosis.timed_out(mon, mon.deadline - start, result[0]))
            return
        event = (seq, kind, "stall")
        if mon.stall_after is None or mon.warned == start:
            return
        if now - start < mon.stall_after and (side is None or event not in side.results):
            return  # not stalled here yet, and no diagnosis came from another rank
        result = self.result(mon, event, now)
        if result is not None:
            mon.warned = start
            # How long it has waited now, when the warning prints (the diagnosis may have taken the
            # listening time); a result sent before this rank's own timer came: at least stall_after.
            _warn(mon, start, max(now - start, mon.stall_after), result)

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
abort.run_at_exit(WATCHDOG.shutdown)  # after the program's own exit handlers, whenever this is imported


def watch(collectives: Watched, twin: type[Monitor]) -> Monitor:
    """A monitor for ``collectives`` over ``twin``'s marks (``monitor.PythonMonitor`` or
    ``step_check.CompiledMonitor``); registered with the watchdog thread when there are 2+ ranks.

    Reads ``MPISTRAT_TIMEOUT`` and ``MPISTRAT_STALL_WARNING_SECONDS`` now (when the strategy is created).
    """
    mon = twin(collectives)
    mon.env_timeout = config.read("MPISTRAT_TIMEOUT")
    mon.env_polled = config.given("MPISTRAT_TIMEOUT")
    mon.stall_after = config.read("MPISTRAT_STALL_WARNING_SECONDS")
    if mon.watched:
        mon.side = Channel() if MPI.Query_thread() >= MPI.THREAD_MULTIPLE else None
        with WATCHDOG.lock:
            WATCHDOG.registry.add(mon)
        WATCHDOG.start()
    WATCHDOG.reap(block=False)  # communicators of collected strategies that could not be freed then
    return mon


def release(
    mon: Monitor, comm: MPI.Intracomm, close: Callable[[], None] | None = None, wait: bool = False
) -> None:
    """Stop watching ``mon``, call ``close``, and free ``comm``: a strategy finalized or garbage-collected.

    With ``wait`` (finalize) it frees now, every rank at the same point of the program. From a
    garbage-collection finalizer (``wait`` False) it only queues: the finalizer may run inside
    another collective on one rank alone, and ``MPI_Comm_free`` there was seen to block while
    the other ranks waited in that collective. The watchdog thread (at thread level
    ``MULTIPLE``), the next strategy created or the exit frees what is queued; never after
    ``MPI_Finalize``, never while the watchdog uses the communicator (``WATCHDOG.lock``).
    """
    WATCHDOG.doomed.append((mon, comm, close))
    if wait:
        WATCHDOG.reap(block=True)


def wait(mon: Monitor, request: MPI.Request) -> None:
    """Complete ``request``, raising ``CollectiveTimeoutError`` once this collective has timed out."""
    mon.polling = True
    spins = 0
    try:
        while not request.Test():
            if mon.expired is not None and mon.lost is not None:
                raise PeerFailedError(mon.expired, (mon.lost,), recoverable=False)
            if mon.expired is not None:
                raise CollectiveTimeoutError(mon.expired)
            spins += 1
            if spins > 2000:  # past the fast path: stop burning a core
                time.sleep(0.0002)
                if mon.deadline is not None:
                    _unattended(mon, time.monotonic() - mon.deadline)
    finally:
        mon.polling = False


def _unattended(mon: Monitor, late: float) -> None:
    """This rank's collective is ``late`` seconds past its deadline and no watchdog thread ended it."""
    if monitor.exited and late > 0:
        # Called from an exit handler that ran after mpistrat's: nothing could catch an error
        # and end the job, so end it here.
        timeout = f" of {mon.deadline - mon.start:g} s" if mon.deadline and mon.start else ""
        abort.abort_job(
            f"{diagnosis.headline(mon)} did not complete within its timeout{timeout}; the missing ranks are "
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


def _warn(mon: Monitor, start: float, waited: float, result: tuple[str, int]) -> None:
    if mon.start != start or result[1] not in (-1, mon.rank):
        return  # it completed meanwhile, or the lowest waiting rank speaks for all of them
    logger.warning(diagnosis.warning(mon, waited, result[0]), extra=ANY_RANK)


def _end(mon: Monitor, start: float, problem: str, lost: int | None = None) -> None:
    """End the job: this collective cannot complete (raise it first where the main thread polls).
    ``lost``: the world rank whose death it waits for (the job ends with ``PEER_FAILED_EXIT``)."""
    if mon.start != start:
        return
    message = diagnosis.aborted(problem)
    code = 1 if lost is None else PEER_FAILED_EXIT
    if mon.polling:
        mon.lost = lost
        mon.expired = message  # the main thread raises CollectiveTimeoutError (PeerFailedError) with it
        abort.abort_later(ABORT_DELAY, f"{mon.kind} (collective #{mon.seq}) could not complete", code)
    else:
        abort.abort_job(message, code)


def duplicate(comm: MPI.Intracomm, timeout: float | None, what: str = "MPIStrategy()") -> MPI.Intracomm:
    """``comm.Dup()`` (collective over ``comm``), bounded: the job ends, with a message naming
    ``what``, when a rank of ``comm`` is heard to have exited, or after ``timeout`` seconds.

    Who exited is known from the strategies this process already watches (see
    ``farewell.leave``); the wait costs nothing until the first poll finds the copy unfinished.
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
