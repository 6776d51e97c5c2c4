"""A collective that fails on some ranks: what its failure tells the rest of the program.

A collective opens with its handshake; once that has passed, every rank is committed to its
transfers. An error raised on one rank after that (in a transfer, or between the transfers of a
collective that makes several, as an optimizer step's update between its reduce-scatter and its
all-gather) leaves the other ranks waiting in a transfer this rank will never join. Such an
error cannot be shared: ``strategy.run``'s closing handshake would wait for ranks that are in a
transfer (and must not be paired with it). So the failure is counted (``Collectives.failures``:
``strategy.run`` then raises the error on this rank alone, and the exception hook ends the job),
and the rank counts as having completed only the collective before (its exit hook then tells the
others, stuck in the transfer, that it left before it, and they end too).

A collective decorated with ``@watchdog.collective`` counts its own failures; a caller that
moves data through several of them after one handshake calls :func:`abandon` when that part
raises.

MPI's own errors return too: the private communicators carry ``MPI.ERRORS_RETURN``, and an
``MPI.Exception`` out of a collective becomes a ``CommunicationError`` in one place,
:func:`from_mpi`, which says what MPI said, where the collective was called and, from every rank's
flight record (asked for over the side channel), the first collective in which the ranks differed:
under ``MPISTRAT_CHECK=step`` a shape that differs in an unchecked collective is what MPI finds
first (Open MPI: ``MPI_ERR_TRUNCATE``). Some errors MPI does not return: MPICH aborts the job on a
message truncated inside a collective, whatever the error handler. A rank's death (ULFM) is not such
an error: it is a ``PeerFailedError``, the communicator revoked so every survivor hears at once, the
job not doomed (``diagnostics/ulfm.py``; the survivors may go on, ``distribute/recovery.py``).

>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> c = Collectives(MPI.COMM_SELF.Dup())
>>> try:
...     raise FloatingPointError("in an update between two transfers")
... except FloatingPointError:
...     abandon(c)
>>> c.failures
1
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpi4py import MPI

from mpistrat.diagnostics import abort, diagnosis, watchdog
from mpistrat.diagnostics.callsite import call_site
from mpistrat.errors import CommunicationError, MpistratError

if TYPE_CHECKING:
    from mpistrat.collectives.state import CollectiveState

__all__ = ["abandon", "from_mpi"]


def abandon(collectives: CollectiveState | None) -> None:
    """Collective #``collectives.seq`` raised on this rank after its handshake, between its transfers:
    count it as that collective's failure (see the module's docstring). None (no collectives): nothing.
    Called where the error is caught, to be raised again: a step pays nothing for it otherwise."""
    if collectives is not None:
        collectives.failures += 1
        monitor = collectives.monitor
        monitor.completed = min(monitor.completed, collectives.seq - 1)


def from_mpi(collectives: CollectiveState, exc: MPI.Exception, kind: str) -> MpistratError:
    """The error MPI's ``exc`` in collective ``kind`` (#``collectives.seq``, on this rank) is raised as:
    a ``PeerFailedError`` where a rank died, else a ``CommunicationError``.

    Asks every rank for its flight record (the side channel, up to ``side_channel.GRACE``) to name
    the first collective in which the ranks differed, and dooms the job: it ends with ``MPI_Abort``
    ``ABORT_DELAY`` seconds later if the error is caught (a collective MPI failed leaves its
    communicator mid-operation), at once through the exception hook if not.
    """
    from mpistrat.diagnostics import ulfm  # an error's path: not every job's

    if ulfm.is_peer_failure(exc, collectives.comm):  # nobody to ask, and the survivors may go on
        return ulfm.peer_failed(collectives.comm, exc, kind, collectives.seq)
    seq, mon = collectives.seq, collectives.monitor
    headline = f"{kind} (collective #{seq}, called at {call_site()}) failed in MPI on rank {collectives.rank}"
    answers = watchdog.WATCHDOG.ask(mon, None) if mon.watched else None
    if answers is None:
        answers = {collectives.rank: mon.state()}
    differed = diagnosis.first_difference(
        {r: a.get("entries", []) for r, a in answers.items()}, collectives.size
    )
    if differed is not None:
        first, what = differed
        cause = (
            f"The ranks differed first at collective #{first}: {what}. Every rank must call the same "
            "collectives, with the same structures, dtypes and shapes, in the same order"
            + ("; run with MPISTRAT_CHECK=1 to stop at the call itself" if collectives.step_check else "")
        )
    elif len(answers) < collectives.size:
        cause = "The other ranks' flight records did not come: where the ranks differed is unknown"
    else:
        cause = "The ranks' flight records agree: MPI's error is not one of differing arguments"
    abort.abort_later(watchdog.ABORT_DELAY, f"{kind} (collective #{seq}) failed in MPI")
    return CommunicationError(
        f"{headline}: {exc.Get_error_string()}. {cause}. The job is aborted: a collective MPI failed "
        "leaves the communicator unusable." + diagnosis.records(mon, answers)
    )
