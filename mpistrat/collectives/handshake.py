"""The handshake: the one agreement every collective opens with.

Every collective is numbered (a per-communicator sequence) and, while checking is
on, opens with one small ``Allreduce(MAX)`` of ``[magic, seq, kind, fingerprint]``,
their negations, an error flag, a spare number and a stop flag. ``max(x) == -max(-x)`` exactly
when every rank sent the same ``x``, so every rank learns at once, at a cost that
does not grow with the number of ranks, whether all entered the same collective
with compatible arguments (nest structure, dtypes, shapes, reduce op). A mismatch
or bad input on any one rank is then raised on every rank instead of deadlocking.

:func:`agree` is the entry for every caller, collective or not: it applies the check
setting, numbers the call, and is watched (timeouts, stall diagnosis) when its caller
is not. Per-rank numbers (all_gather's sizes) follow in one ``Allgather``; one
number's maximum over the ranks rides in the handshake itself, and so does
``Collectives.stop_requested`` (a preemption signal seen on any rank): once any rank sets
it, every rank's ``stop_agreed`` turns true at the same collective, at no extra cost.

>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> Collectives(MPI.COMM_SELF.Dup()).agree("example", extras=[3]).tolist()
[[3]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from mpistrat import mismatch, watchdog
from mpistrat.options import CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["agree", "check_enabled", "check_level", "code"]

_MAGIC = 0x6D707374  # "mpst"
_STOP = 10  # the slot of the stop flag (mpistrat.preemption)


def check_enabled(collectives: Collectives, options: CommunicationOptions | None = None) -> bool:
    """Whether the handshake check runs for a call with ``options`` (default: the strategy's)."""
    return check_level(collectives, options) > 0


def check_level(collectives: Collectives, options: CommunicationOptions | None = None) -> int:
    """0: no check; 1: the handshake (the default); 2 (``strict``): also compare the copies of
    the variables every-rank merge functions update. The call's option, else the strategy's,
    else ``MPISTRAT_CHECK`` as it was when the strategy was created."""
    for chosen in (options, collectives.options):
        if chosen is not None and chosen.check is not None:
            return 2 if chosen.check == "strict" else int(bool(chosen.check))
    return collectives.check


@functools.lru_cache(maxsize=256)
def code(text: str) -> int:
    """A number for ``text`` that is the same on every rank (a kind, a description)."""
    return mismatch.hash64(text)


@watchdog.collective("handshake")  # watched on its own when a caller opens with it alone
def agree(
    self: Collectives,
    kind: str,
    *,
    fingerprint: int = 0,
    describe: Callable[[], Any] | None = None,
    error: BaseException | None = None,
    extras: list[int] | None = None,
    maximum: int | None = None,
    options: CommunicationOptions | None = None,
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
        options: the call's options (their ``check``; the default: the strategy's).

    Returns:
        With ``extras``, every rank's extras (a table, one row per rank); with
        ``maximum``, the largest value (None when the check is off: unknown).

    With the check off (and no ``extras``) nothing is sent: the call is numbered, and
    ``error`` is raised on this rank alone.
    """
    if extras is None and not check_enabled(self, options):
        if error is not None:
            raise error
        self.seq += 1
        return None
    self.seq += 1
    seq, kind_code = self.seq, code(kind)
    send, recv = self._handshake_send, self._handshake_recv  # reused: this is per-call overhead
    send[:8] = (_MAGIC, seq, kind_code, fingerprint, -_MAGIC, -seq, -kind_code, -fingerprint)
    send[8], send[9], send[_STOP] = error is not None, maximum or 0, self.stop_requested
    # Always the non-blocking form: MPI never matches a blocking collective with a non-blocking
    # one, and a rank whose timeout is set (per call, or in its environment) must poll.
    request = self.comm.Iallreduce(send, recv, op=MPI.MAX)
    if not self.monitor.polled:
        request.Wait()
    else:  # polled, so a timeout raises here (a late or missing rank stops everyone at this point)
        watchdog.wait(self.monitor, request)
    top = recv.tolist()
    self.handshakes += 1
    if top[_STOP]:
        self.stop_agreed = True
    if top[8] or top[:4] != [-f for f in top[4:8]]:
        self.disagreements += 1
        mismatch.raise_disagreement(self.comm, kind, self.seq, describe or (lambda: None), error)
    if extras is None:
        return None if maximum is None else top[9]
    mine = np.asarray(extras, dtype=np.int64)
    everyone = np.empty((self.size, mine.size), dtype=np.int64)
    if mine.size:
        self.comm.Allgather(mine, everyone)
    return everyone
