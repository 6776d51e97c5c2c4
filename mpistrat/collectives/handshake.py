"""The handshake: the one agreement every collective opens with.

Every collective is numbered (a per-communicator sequence) and, while checking is
on, opens with one small ``Allreduce(MAX)`` of ``[magic, seq, kind, fingerprint]``,
their negations, an error flag, a spare number, who arrived last at the previous
handshake (see :mod:`mpistrat.diagnostics.stragglers`) and a stop flag
(:mod:`mpistrat.checkpoint.preemption`).
``max(x) == -max(-x)`` exactly
when every rank sent the same ``x``, so every rank learns at once, at a cost that
does not grow with the number of ranks, whether all entered the same collective
with compatible arguments (nest structure, dtypes, shapes, reduce op). A mismatch
or bad input on any one rank is then raised on every rank instead of deadlocking.

:func:`agree` is the entry for every caller, collective or not: it applies the check
setting, numbers the call, and is watched (timeouts, stall diagnosis) when its caller
is not. Per-rank numbers (all_gather's sizes) follow in one ``Allgather``; one
number's maximum over the ranks rides in the handshake itself, and so does the request
of a :class:`StopState` (``Collectives.stop``: a preemption signal seen on any rank):
once any rank requests a stop, its ``agreed`` turns true on every rank at the same
collective, at no extra cost.

>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> Collectives(MPI.COMM_SELF.Dup()).agree("example", extras=[3]).tolist()
[[3]]
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
from mpi4py import MPI

from mpistrat.collectives import failure, mismatch
from mpistrat.collectives.fingerprint import cached_code
from mpistrat.collectives.native import native_step
from mpistrat.collectives.step_check import MASK, defer
from mpistrat.diagnostics import monitor as monitoring
from mpistrat.diagnostics import stragglers, timeline, watchdog
from mpistrat.diagnostics.flight import ENDED, SITE, STATE
from mpistrat.errors import CollectiveTimeoutError, ContextError
from mpistrat.options import CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.collectives.state import CollectiveState as Collectives

__all__ = [
    "SLOTS",
    "StopState",
    "agree",
    "agree_within",
    "check_enabled",
    "check_level",
    "close_step",
    "level",
    "persistent",
    "skip_closing",
]

_MAGIC = 0x6D707374  # "mpst"

# The slots of the handshake's int64 vector. A new one is a name here and SLOTS one more.
MAGIC, SEQ, KIND, FINGERPRINT = range(4)  # the same on every rank; their negations follow
NEGATED = 4  # -MAGIC at NEGATED + MAGIC, ...
ERROR = 8  # 1: some rank found bad input
MAXIMUM = 9  # a number whose largest value over the ranks the caller asked for
LAST_ARRIVAL = 10  # (-wait, rank) at the previous handshake: the last to arrive (diagnostics/stragglers.py)
LONGEST_WAIT = 11  # (wait, rank) at the previous handshake: how long the first waited
STOP = 12  # 1: some rank was asked to stop (a preemption signal; see mpistrat.checkpoint.preemption)
SLOTS = 13
# Writes and reads the whole vector in one call, straight into the reused NumPy buffers (a
# tuple assigned to an ndarray slice converts element by element: twice the time).
_PACKING = struct.Struct(f"@{SLOTS}q")  # native: int64, as the buffers
_MAX = MPI.MAX
_get_ident = threading.get_ident
_STEP_OR_UNSET = (None, "step")  # a call's CommunicationOptions.check that leaves the setting as it is


def persistent(comm: MPI.Intracomm, send: np.ndarray, recv: np.ndarray) -> MPI.Prequest | None:
    """The handshake as a persistent collective (MPI-4 ``Allreduce_init``), made by every rank at the
    same point (the strategy's creation) and started by every handshake: no argument parsing, no new
    schedule, 1-1.6 µs less per handshake than ``Iallreduce`` on MPICH, Open MPI and Intel MPI
    (``benchmarks/closing.py``).

    None (every handshake an ``Iallreduce``) where the MPI lacks it, and on one rank, where a
    handshake waits for nobody (the default strategy's ``COMM_SELF``, which ``MPI_Finalize`` frees,
    then holds no request that MPICH would report).
    """
    if comm.Get_size() == 1:
        return None
    try:
        return comm.Allreduce_init([send, MPI.INT64_T], [recv, MPI.INT64_T], _MAX)
    except NotImplementedError:
        return None


class _Abandoned:
    """The persistent handshake after a wait that raised (a timeout, an interrupt): it may still be
    active, so starting it again would be erroneous; this rank's next handshake raises instead."""

    def __init__(self, seq: int):
        self.seq = seq

    def Start(self) -> None:
        raise CollectiveTimeoutError(
            f"the handshake of collective #{self.seq} on this strategy did not complete (it timed out "
            "or was interrupted), so its communicator cannot carry another: create a new strategy"
        )


def check_enabled(collectives: Collectives, options: CommunicationOptions | None = None) -> bool:
    """Whether the handshake check runs for a call with ``options`` (default: the collectives' own)."""
    return check_level(collectives, options) > 0


def check_level(collectives: Collectives, options: CommunicationOptions | None = None) -> int:
    """0: no check; 1: the handshake (the default); 2 (``strict``): also compare the copies of
    the variables every-rank merge functions update. The call's option, else the collectives'
    level (``Collectives.check``: their option, else ``MPISTRAT_CHECK`` at their creation)."""
    if options is None or options.check is None:
        return collectives.check
    return level(options.check)


def level(check: bool | int | str) -> int:
    """The level of a check setting, a ``CommunicationOptions.check`` value or ``MPISTRAT_CHECK``'s
    (0, 1, 2 or ``"step"``): 0 off, 1 on (``"step"`` too: its handshakes check at level 1), 2 strict."""
    return 2 if check in ("strict", 2) else int(bool(check))


class StopState:
    """A stop asked for on this rank, and whether every rank has learned of one (preemption).

    Each ``Collectives`` owns one (``collectives.stop``) and passes it to whoever asks to
    stop. :meth:`request` only sets a flag (safe in a signal handler); the next handshake
    carries it (``Allreduce(MAX)``), and from that collective on :attr:`agreed` is true on
    every rank. :meth:`clear` once the stop was handled.

    >>> stop = StopState()
    >>> stop.request(); stop.requested, stop.agreed
    (True, False)
    """

    __slots__ = ("_agreed", "requested")

    def __init__(self) -> None:
        self.requested = False  # read by every handshake: a plain attribute, no property
        self._agreed = False

    def request(self) -> None:
        """Ask every rank to stop: the next handshake carries the request."""
        self.requested = True

    @property
    def agreed(self) -> bool:
        """Whether a handshake has carried some rank's request (the same answer on every rank)."""
        return self._agreed

    def learned(self) -> None:
        """The handshake's: some rank's request reached every rank at this collective."""
        self._agreed = True

    def clear(self) -> None:
        """Forget the request and the agreement (the stop was handled)."""
        self.requested = self._agreed = False


def agree_within(
    self: Collectives,
    kind: str,
    *,
    fingerprint: int = 0,
    describe: Callable[[], Any] | None = None,
    error: BaseException | None = None,
    extras: list[int] | None = None,
    maximum: int | None = None,
    options: CommunicationOptions | None = None,
    deferrable: bool = False,
    closing: bool = False,
) -> Any:
    """Agree with every rank on entering collective ``kind`` with matching arguments.

    Args:
        kind: the collective's name; ranks in different collectives raise.
        fingerprint: a number for this rank's arguments (structure, dtypes, shapes);
            ranks whose numbers differ raise ``CollectiveMismatchError``.
        describe: returns a picklable description of this rank's arguments; called only
            when something disagrees, to say what.
        error: a bad-input error this rank found: raised on every rank.
        extras: per-rank numbers, gathered once all agree (the handshake then always runs).
        maximum: a number whose largest value over the ranks is returned.
        options: the call's options (their ``check``; the default: the collectives' own).
        deferrable: under ``MPISTRAT_CHECK=step``, once the first step was checked, this call
            (no extras or maximum) sends nothing: it is checked at the next handshake that
            sends (see :mod:`.step_check`), and ``error`` is raised on this rank alone. Data
            collectives pass True; a handshake whose news may come from one rank alone (an
            error, a stop) does not.
        closing: a step's closing handshake (``strategy.run``'s): under ``step`` it ends the
            first step's checking call by call (after that a step closes with
            :func:`close_step`).

    Returns:
        With ``extras``, every rank's extras (a table, one row per rank); with
        ``maximum``, the largest value (None when the check is off: unknown).

    With the check off (and no ``extras``) nothing is sent: the call is numbered, and
    ``error`` is raised on this rank alone.
    """
    # check_level, inlined: this is every call's path with the check off
    if extras is None and not (
        self.check if options is None or options.check is None else level(options.check)
    ):
        if error is not None:
            raise error
        self.seq += 1
        return None
    step = self.step_check
    if (
        deferrable
        and maximum is None
        and extras is None
        and step is not None
        and not step.learning
        and (options is None or options.check in _STEP_OR_UNSET)
    ):
        if error is not None:  # as with the check off: the others are in the transfer
            self.seq += 1
            raise error
        if defer(step, self.seq + 1, kind, fingerprint):
            self.seq += 1
            return None
    self.seq += 1
    top = _exchange(self, kind, fingerprint, describe, error, maximum or 0)
    if closing and step is not None:
        step.learned()
    if extras is None:
        return None if maximum is None else top[MAXIMUM]
    mine = np.asarray(extras, dtype=np.int64)
    everyone = np.empty((self.size, mine.size), dtype=np.int64)
    if mine.size:
        self.comm.Allgather(mine, everyone)
    return everyone


def close_step(self: Collectives, kind: str, fingerprint: int, describe: Callable[[], Any]) -> None:
    """Under ``MPISTRAT_CHECK=step``, once the first step was checked: the handshake that closes a
    step (``strategy.run``'s, ``kind``) with collectives left unchecked, which it checks beside its
    own ``fingerprint``. What ``agree`` does for the same call, without its arguments' handling or
    its generic watch (this is every step's path); then the straggler tally forgets it, whatever
    came of it (who arrives last at a step's end says nothing new: the step's collectives did).

    Watched as every collective is: a stall or timeout in it is named. Its common case (not polled,
    no timeline) runs compiled where it was built (:mod:`.native`), to the same effect.
    """
    native = self.native_closing
    if native is None:
        native = self.native_closing = _native_closing(self, kind)
    try:
        if native and native.close(self, kind, fingerprint, describe):
            return
        try:
            _close_in_python(self, kind, fingerprint, describe)
        finally:
            self.stragglers.forget()
    except MPI.Exception as exc:  # as the watch of every other collective turns it
        raise failure.from_mpi(self, exc, kind) from exc


def _close_in_python(self: Collectives, kind: str, fingerprint: int, describe: Callable[[], Any]) -> None:
    """:func:`close_step` but its tally's ``forget()``, in Python: the compiled closing's twin."""
    monitor = self.monitor
    me = _get_ident()
    if not monitor.busy.acquire(False):  # as the watch of every collective does
        if monitor.thread != me:
            raise ContextError(monitoring.two_threads(monitor, me, kind))
        self.seq += 1  # inside this thread's own collective: part of it
        _exchange(self, kind, fingerprint, describe, None, 0)
        return
    monitor.thread = me
    try:
        self.seq += 1
        # The watch that monitor.collective wraps every collective in, inline: every step's path.
        chosen = self.options.timeout_seconds
        timeout = chosen or monitor.env_timeout
        monitor.kind = kind
        monitor.start = began = time.monotonic()
        monitor.deadline = None if timeout is None else began + timeout
        polled = chosen is not None or monitor.env_polled or monitoring.exited  # after the exit hook: polled
        monitor.polled = timeout is not None and polled
        try:
            _exchange(self, kind, fingerprint, describe, None, 0)
            monitor.completed = self.seq
        finally:
            monitor.start = monitor.deadline = None
            monitor.polled = False
            monitor.last = (kind, self.seq, ended := time.monotonic())
            if timeline.writer is not None:
                timeline.writer.collective(self, kind, began, ended, ())
    except BaseException:
        self.failures += 1
        raise
    finally:
        monitor.last_thread, monitor.thread = me, None
        monitor.busy.release()


def skip_closing(self: Collectives, kind: str) -> None:
    """Under ``MPISTRAT_CHECK=step``, once the first step was checked: the closing of a step that
    left nothing unchecked (on every rank alike: the last handshake cleared every rank's record).
    Nothing is sent; it is numbered and marked finished, as a closing that sent."""
    self.seq += 1
    monitor = self.monitor
    monitor.completed = self.seq
    monitor.last = (kind, self.seq, time.monotonic())
    self.stragglers.forget()


def _exchange(
    self: Collectives,
    kind: str,
    fingerprint: int,
    describe: Callable[[], Any] | None,
    error: BaseException | None,
    maximum: int,
) -> tuple[int, ...]:
    """The handshake of collective #``self.seq`` (numbered by the caller): send, wait, raise on every
    rank if any rank's differed; returns the combined vector. Under ``step`` it carries the code of
    the unchecked collectives, and clears them once every rank agreed."""
    seq = self.seq
    codes = self.caches.codes
    kind_code = codes.get(kind) or cached_code(codes, kind, kind.__str__)  # a miss: the kind's first call
    step = self.step_check
    if step is not None:
        fingerprint ^= step.code()  # this handshake checks the unchecked collectives too
    send, recv, handshake, messages, stop = self.handshake_buffers  # reused: per-call overhead
    tally = self.stragglers
    last, longest = tally.outgoing
    _PACKING.pack_into(  # in slot order
        send, 0,  # type: ignore[arg-type]  # an ndarray is a buffer
        _MAGIC, seq, kind_code, fingerprint,  # MAGIC ... FINGERPRINT
        -_MAGIC, -seq, -kind_code, -fingerprint,  # at NEGATED
        error is not None, maximum, last, longest,  # ERROR, MAXIMUM, LAST_ARRIVAL, LONGEST_WAIT
        stop.requested,  # STOP
    )  # fmt: skip
    began = time.monotonic()
    # Never the blocking form: MPI matches a blocking collective with neither a non-blocking nor a
    # persistent one, and a rank whose timeout is set (per call, or in its environment) must poll.
    if handshake is not None:
        handshake.Start()
        request = handshake
    else:
        request = self.comm.Iallreduce(messages[0], messages[1], _MAX)
    # Recorded after the start: where the MPI moves the message on its own this overlaps it (most move
    # it inside Wait: benchmarks/closing.py), and nothing reads it before the handshake completes.
    entry = [seq, kind, fingerprint, began, None, None, None]  # flight.entry(), built inline: per-call
    self.flight.append(entry)
    monitor = self.monitor
    if not monitor.polled:
        request.Wait()
    else:  # polled, so a timeout raises here (a late or missing rank stops everyone at this point)
        try:
            watchdog.wait(monitor, request)
        except BaseException:
            if handshake is not None:  # it may still be active: neither started nor freed again
                self.handshake_buffers = (send, recv, _Abandoned(seq), messages, stop)
                self.requests.remove(handshake)
                self.native_closing = False  # which would start it
            raise
    entry[ENDED] = ended = time.monotonic()
    top = _PACKING.unpack_from(recv)  # type: ignore[arg-type]
    tally.learn(top[LAST_ARRIVAL], top[LONGEST_WAIT], ended - began)
    if timeline.writer is not None:
        entry[SITE] = timeline.writer.handshake(self, seq, kind, began, ended)
    self.handshakes += 1
    if top[STOP]:
        stop.learned()
    if top[ERROR] or top[0] + top[4] or top[1] + top[5] or top[2] + top[6] or top[3] + top[7]:
        _disagreed(self, kind, describe, error, entry)
    monitor.agreed = monitor.start  # every rank has entered this collective (for the watchdog)
    if step is not None:
        step.verified()
    return top


def _disagreed(
    self: Collectives,
    kind: str,
    describe: Callable[[], Any] | None,
    error: BaseException | None,
    entry: list[Any],
) -> NoReturn:
    """A handshake found that the ranks differ (on every rank alike): raise, naming what differed."""
    self.disagreements += 1
    entry[STATE] = "raised: the ranks disagreed"
    step = self.step_check
    if step is not None:  # the same on every rank: the setting was agreed at creation
        step.raise_first_difference(self.comm)
    mismatch.raise_disagreement(self.comm, kind, self.seq, describe or (lambda: None), error)


def _native_closing(self: Collectives, kind: str) -> Any:
    """The compiled closing of ``kind`` for these collectives, or False where close_step must run in
    Python: not built or turned off (:mod:`.native`), no persistent handshake, or a watch that
    polls (a timeout chosen in the options, or set in the environment and not ``off``)."""
    send, recv, handshake, _, stop = self.handshake_buffers
    monitor = self.monitor
    step = self.step_check
    if (
        native_step is None
        or not isinstance(handshake, MPI.Prequest)
        or step is None
        or self.options.timeout_seconds is not None
        or (monitor.env_polled and monitor.env_timeout is not None)
    ):
        return False
    return native_step.Closing(
        monitor=monitor,
        busy=monitor.busy,
        flight=self.flight,
        tally=self.stragglers,
        stop=stop,
        record=step.record,
        send=send,
        recv=recv,
        request=handshake,
        timeline=timeline,
        monitoring=monitoring,
        kind=kind,
        kind_code=cached_code(self.caches.codes, kind, kind.__str__),
        magic=_MAGIC,
        timeout=monitor.env_timeout,
        disagreed=_disagreed,
        nothing=stragglers.NOTHING,
        fold_every=stragglers.FOLD_EVERY,
        mask=MASK,
    )


# Watched on its own when a caller opens with it alone; a collective already watched opens with
# ``agree_within`` itself (the watch would find it inside that collective and pass it through).
agree = watchdog.collective("handshake")(agree_within)
