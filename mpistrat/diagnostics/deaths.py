"""A rank's death that MPI does not report: its process ended, seen from a rank on its machine.

Without ULFM, MPI says nothing when a rank is killed: where the launcher leaves the others
running (``srun`` without ``--kill-on-bad-exit``), they wait for it in their next collective
until ``MPISTRAT_TIMEOUT``. So each rank watches one other rank on its machine, the next in rank
order among the ranks there (each is watched once), through a ``pidfd`` (Linux 5.3 and later):
the watchdog thread looks at it a few times a second (one ``select``, no message). When the
process ends before its rank said it leaves (``farewell.py``), the watchdog tells every rank over
the side channel, and a collective that waits for the dead rank ends on every rank at once,
naming it and the optimizer step each rank was at (``diagnosis.died``), with exit status 76
(``PEER_FAILED_EXIT``: ``jobs/train.sbatch`` relaunches on it).

Ranks are on one machine when they share its boot and PID namespace
(``comm.devices.process_identity``), not only its host name: a container or a virtual node with
its own PID namespace watches its own. A rank alone on its machine is watched by nobody: a whole
node lost is left to the launcher (or to ``MPISTRAT_TIMEOUT``). Where a death can be survived
(ULFM), MPI reports it and nothing is watched.

>>> watch([("m", 10), ("m", 11), ("n", 12)], rank=2) is None  # alone on its machine
True
"""

from __future__ import annotations

import contextlib
import os
import select
import weakref

from mpi4py import MPI

__all__ = ["Watch", "watch", "world_rank"]


class Watch:
    """A ``pidfd`` of rank ``rank``'s process (``pid``): readable once that process has ended."""

    def __init__(self, rank: int, pid: int, fd: int):
        self.rank, self.pid, self.fd = rank, pid, fd
        self.seen = False  # its end was acted on (the watchdog tells the others once)
        weakref.finalize(self, _close, fd)

    def ended(self) -> bool:
        """Whether the process has ended (no waiting)."""
        try:
            return bool(select.select([self.fd], [], [], 0)[0])
        except (OSError, ValueError):
            return False


def watch(processes: list[tuple[str, int]] | tuple[tuple[str, int], ...], rank: int) -> Watch | None:
    """The watch rank ``rank`` keeps over the next rank on its machine (``processes``: every rank's
    ``comm.devices.process_identity()``, in rank order); None when it is alone there, or without
    ``pidfd``."""
    machine = processes[rank][0]
    mates = [r for r, (m, _) in enumerate(processes) if m == machine]
    if not machine or len(mates) < 2 or not hasattr(os, "pidfd_open"):
        return None
    other = mates[(mates.index(rank) + 1) % len(mates)]
    pid = processes[other][1]
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # it has ended already: a pidfd of nothing reads as ended
        fd = os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None
    return Watch(other, pid, fd)


def world_rank(comm: MPI.Comm, rank: int) -> int:
    """``rank`` of ``comm`` in ``COMM_WORLD`` (-1 where it cannot be told)."""
    try:
        group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    except MPI.Exception:
        return -1
    try:
        return int(group.Translate_ranks([rank], world)[0])
    finally:
        group.Free()
        world.Free()


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
