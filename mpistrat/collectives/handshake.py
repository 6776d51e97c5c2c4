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
of a ``stop.StopState`` (``Collectives.stop``: a preemption signal seen on any rank):
once any rank requests a stop, its ``agreed`` turns true on every rank at the same
collective, at no extra cost.

>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> Collectives(MPI.COMM_SELF.Dup()).agree("example", extras=[3]).tolist()
[[3]]
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.fingerprint import cached_code
from mpistrat.diagnostics import timeline, watchdog
from mpistrat.diagnostics.flight import ENDED, SITE, STATE
from mpistrat.errors import CollectiveTimeoutError
from mpistrat.options import CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.collectives.state import CollectiveState

__all__ = [
    "MAGIC_NUMBER",
    "SLOTS",
    "agree",
    "agree_within",
    "check_enabled",
    "check_level",
    "disagreed",
    "exchange",
    "level",
    "persistent",
]

MAGIC_NUMBER = 0x6D707374  # "mpst": the handshake's first slot

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


def check_enabled(collectives: CollectiveState, options: CommunicationOptions | None = None) -> bool:
    """Whether the handshake check runs for a call with ``options`` (default: the collectives' own)."""
    return check_level(collectives, options) > 0


def check_level(collectives: CollectiveState, options: CommunicationOptions | None = None) -> int:
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


def agree_within(
    self: CollectiveState,
    kind: str,
    *,
    fingerprint: int = 0,
    describe: Callable[[], Any] | None = None,
    error: BaseException | None = None,
    extras: list[int] | None = None,
    maximum: int | None = None,
    options: CommunicationOptions | None = None,
    deferrable: bool = False,
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
        if step.defer(self.seq + 1, kind, fingerprint):
            self.seq += 1
            return None
    self.seq += 1
    top = exchange(self, kind, fingerprint, describe, error, maximum or 0)
    if extras is None:
        return None if maximum is None else top[MAXIMUM]
    mine = np.asarray(extras, dtype=np.int64)
    everyone = np.empty((self.size, mine.size), dtype=np.int64)
    if mine.size:
        self.comm.Allgather(mine, everyone)
    return everyone


def exchange(
    self: CollectiveState,
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
        MAGIC_NUMBER, seq, kind_code, fingerprint,  # MAGIC ... FINGERPRINT
        -MAGIC_NUMBER, -seq, -kind_code, -fingerprint,  # at NEGATED
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
    monitor.handshakes += 1
    if top[STOP]:
        stop.reached()
    if top[ERROR] or top[0] + top[4] or top[1] + top[5] or top[2] + top[6] or top[3] + top[7]:
        disagreed(self, kind, describe, error, entry)
    monitor.agreed = monitor.start  # every rank has entered this collective (for the watchdog)
    if step is not None:
        step.verified()
    return top


def disagreed(
    self: CollectiveState,
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
    from mpistrat.collectives import mismatch  # the ranks disagree: not every job's path

    mismatch.raise_disagreement(self.comm, kind, self.seq, describe or (lambda: None), error)


# Watched on its own when a caller opens with it alone; a collective already watched opens with
# ``agree_within`` itself (the watch would find it inside that collective and pass it through).
agree = watchdog.collective("handshake")(agree_within)
