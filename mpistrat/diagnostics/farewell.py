"""The exit handshake: every rank says it leaves, and no side-channel message is left unread.

A rank that exits tells its strategies' coordinators (``left``), so ranks still waiting in a
collective it will never join end at once, naming it. At the end of a normal job those
messages used to stay unread: the coordinator's watchdog had stopped, MPI was finalized over
them, and MPI libraries whose network path keeps unmatched messages (UCX, between nodes)
printed ``unexpected tag-receive descriptor ... was not matched`` for a job that succeeded.

Now each rank, per watched strategy, at exit:

1. waits until every side-channel message it sent earlier was received (they are synchronous
   sends, ``issend``), reading what arrives meanwhile;
2. sends ``left`` to its coordinator (rank 1 for rank 0, rank 0 for the others), and sends
   nothing else from then on (it reads, and answers no query);
3. rank 0 waits for every other rank's ``left``, then sends each of them ``bye``; the others
   read until their ``bye`` comes.

Each ``left`` carries the rank's record of the collectives nothing has checked yet
(``MPISTRAT_CHECK=step``: those after the last handshake, such as a cross-replica ``reduce``
after the last step; nearly always none). Rank 0 compares them with its own once every rank has
left: where they differ, no handshake will ever check them, so it names the first collective in
which the ranks differed and ends the job non-zero (``MPI_Abort``), as the handshake would have.

When rank 0 has every ``left``, no rank has an unread message from anyone but rank 0 (step 1
and 2: each rank's earlier messages were received before it said ``left``), and MPI delivers
rank 0's messages to a rank in the order it sent them, ``bye`` last. So a rank that read its
``bye`` has read everything sent to it. Per strategy that is R-1 ``left`` and R-1 ``bye``
messages, O(R) in all. MPI_Finalize waits for every rank anyway (MPICH, Open MPI, Intel
MPI), so the wait costs a normal job nothing; it is bounded by :data:`FAREWELL` seconds for
ranks that never come (a rank stopped outside Python, a job that is being aborted).

>>> FAREWELL > 0
True
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from mpi4py import MPI

from mpistrat.diagnostics import abort, diagnosis
from mpistrat.diagnostics.side_channel import TAG, SideChannel

if TYPE_CHECKING:
    from mpistrat.diagnostics.monitor import Monitor

__all__ = ["FAREWELL", "leave"]

FAREWELL = 30.0  # seconds a rank waits at exit for the other ranks' handshake
_NAP = 0.005  # seconds between reads while waiting


def leave(channel: SideChannel) -> None:
    """Say this rank leaves every watched strategy, and read every message still sent to it.

    Called by the exit hook after the watchdog thread stopped. A forked child (another
    process than the rank's) and a process whose MPI is finalized do nothing.
    """
    if not MPI.Is_initialized() or MPI.Is_finalized() or os.getpid() != channel.pid:
        return
    with channel.lock:
        mons = [m for m in channel.registry if m.side is not None and m.watched]
    if not mons:
        return
    why, world = diagnosis.exit_reason(), MPI.COMM_WORLD.Get_rank()
    ends = time.monotonic() + FAREWELL
    said, done = False, set[int]()  # ids of the monitors whose handshake is over
    sent: list[MPI.Request] = []  # kept until the end: a request holds its pickled message
    while len(done) < len(mons) and time.monotonic() < ends:
        with channel.lock:
            channel.sends[:] = [r for r in channel.sends if not r.Test()]
            for mon in mons:
                if id(mon) not in done and _read(mon):
                    done.add(id(mon))
            if not said and not channel.sends:  # everything sent before is read: say it leaves
                said = True
                for mon in mons:
                    coordinator = 1 if mon.rank == 0 else 0
                    left = ("left", mon.rank, mon.completed, why, world, _unchecked(mon))
                    sent.append(mon.comm.isend(left, dest=coordinator, tag=TAG))
            if said:
                for mon in mons:
                    if mon.rank == 0 and id(mon) not in done and _everyone_left(mon):
                        _compare_unchecked(mon)
                        sent += [mon.comm.isend(("bye", 0), dest=r, tag=TAG) for r in range(1, mon.size)]
                        done.add(id(mon))
        if len(done) < len(mons):
            time.sleep(_NAP)
    ends = time.monotonic() + _NAP * 100
    while not MPI.Request.Testall(sent) and time.monotonic() < ends:  # small: sent at once, as a rule
        time.sleep(_NAP)
    with channel.lock:
        channel.sends += sent  # a request still under way stays alive until MPI_Finalize


def _unchecked(mon: Monitor) -> list[object]:
    """This rank's record of the collectives no handshake has checked yet (flat), if any."""
    owner = mon.owner()
    return owner.flight.unchecked() if owner is not None and hasattr(owner, "flight") else []


def _compare_unchecked(mon: Monitor) -> None:
    """Rank 0, once every rank has left: end the job if the ranks' unchecked collectives differ."""
    assert mon.side is not None
    records = {**mon.side.unchecked, 0: _unchecked(mon)}
    entries = {r: list(zip(rec[0::3], rec[1::3], rec[2::3], strict=True)) for r, rec in records.items()}
    differed = diagnosis.first_difference(entries, mon.size)
    if differed is None:
        return
    seq, what = differed
    abort.abort_job(
        f"CollectiveMismatchError at exit: collective #{seq} ran unchecked (MPISTRAT_CHECK=step) and the "
        f"ranks were not in the same collective with the same arguments: {what}. No handshake checked it "
        "before the program ended (experimental_finalize() or the next step would have raised this). "
        "Every rank must call the same collectives, with the same structures, dtypes and shapes, in the "
        "same order; run with MPISTRAT_CHECK=1 to stop at the call itself."
    )


def _everyone_left(mon: Monitor) -> bool:
    assert mon.side is not None
    return len(set(mon.side.departed) - {mon.rank}) == mon.size - 1


def _read(mon: Monitor) -> bool:
    """Read every side-channel message waiting for ``mon``'s rank; True once ``bye`` came (rank > 0).

    Nothing is answered: a rank that leaves sends no more. A ``left`` is filed, so rank 0
    knows who is still to come.
    """
    side = mon.side
    assert side is not None
    status, bye = MPI.Status(), False
    while (message := mon.comm.improbe(MPI.ANY_SOURCE, TAG, status)) is not None:
        what, ref, *payload = message.recv()
        if what == "left":
            side.departed.setdefault(ref, (payload[0], payload[1]))
            side.unchecked[ref] = payload[3] if len(payload) > 3 else []
        elif what == "bye":
            bye = True
    return bye and mon.rank != 0
