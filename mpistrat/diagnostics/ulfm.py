"""A rank's death, as MPI reports it: which errors mean it, who died, and whether the job can go on.

Under ULFM (Open MPI 5 launched with ``mpiexec --with-ft ulfm``) an operation that needs a dead
rank fails with ``MPI_ERR_PROC_FAILED`` (or ``..._PENDING``), and one on a communicator another
survivor revoked with ``MPI_ERR_REVOKED``. :func:`peer_failed` turns either into
:class:`~mpistrat.errors.PeerFailedError` and revokes the communicator first, so that every
survivor blocked in any operation on it hears at once (``MPI_Comm_revoke`` is local and does not
wait). Elsewhere MPI libraries end the job themselves, or report the failure with another class:
there :func:`is_peer_failure` is false and nothing is converted.

:func:`fault_tolerance` says whether this launch can survive a death, and why not.

>>> live, why = fault_tolerance({})
>>> isinstance(live, bool) and isinstance(why, str)
True
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

from mpi4py import MPI

from mpistrat.errors import PeerFailedError

__all__ = [
    "CLASSES",
    "failed_world_ranks",
    "fault_tolerance",
    "is_peer_failure",
    "live",
    "peer_failed",
    "revoke",
]

# The error classes of a dead peer. mpi4py gives a library without them MPI_ERR_UNKNOWN's value:
# never take that for a death.
CLASSES = frozenset(
    c
    for c in (
        getattr(MPI, "ERR_PROC_FAILED", MPI.ERR_UNKNOWN),
        getattr(MPI, "ERR_PROC_FAILED_PENDING", MPI.ERR_UNKNOWN),
        getattr(MPI, "ERR_REVOKED", MPI.ERR_UNKNOWN),
    )
    if c != MPI.ERR_UNKNOWN
)
_TRUE = ("1", "true", "yes", "on")
_live: bool | None = None


def is_peer_failure(exc: BaseException, comm: MPI.Comm | None = None) -> bool:
    """Whether ``exc`` is MPI saying a peer died (or a survivor revoked the communicator): its class,
    or, for another class out of an operation on ``comm`` (Open MPI's non-blocking and persistent
    collectives report ``MPI_ERR_OTHER``), a failed rank or a revocation known on ``comm``."""
    if not isinstance(exc, MPI.Exception) or not CLASSES:
        return False
    try:
        if exc.Get_error_class() in CLASSES:
            return True
        return comm is not None and (comm.Is_revoked() or bool(failed_world_ranks(comm)))
    except Exception:
        return False


def revoke(comm: MPI.Comm | None) -> None:
    """Revoke ``comm`` (local, never waits): every rank's pending and later operations on it fail."""
    if comm is None or comm == MPI.COMM_NULL:
        return
    with contextlib.suppress(Exception):  # revoked already, or a library without ULFM
        comm.Revoke()


def failed_world_ranks(comm: MPI.Comm) -> tuple[int, ...]:
    """The ``COMM_WORLD`` ranks of ``comm`` this process knows to have failed (local, no message)."""
    try:
        failed = comm.Get_failed()
    except Exception:
        return ()
    try:
        if failed.Get_size() == 0:
            return ()
        world = MPI.COMM_WORLD.Get_group()
        try:
            ranks = failed.Translate_ranks(list(range(failed.Get_size())), world)
        finally:
            world.Free()
        return tuple(sorted(int(r) for r in ranks if r != MPI.UNDEFINED))
    finally:
        with contextlib.suppress(Exception):
            failed.Free()


def peer_failed(comm: MPI.Comm, exc: BaseException, kind: str, seq: int | None = None) -> PeerFailedError:
    """The :class:`PeerFailedError` of ``exc`` raised by collective ``kind`` on ``comm``, which is
    revoked first, so the other survivors hear of it at once."""
    revoke(comm)
    ranks = failed_world_ranks(comm)
    who = (
        f"world rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} failed"
        if ranks
        else "a rank failed (revoked by another survivor)"
    )
    where = kind if seq is None else f"{kind} (collective #{seq})"
    said = exc.Get_error_string().strip() if isinstance(exc, MPI.Exception) else str(exc)
    return PeerFailedError(f"{where}: {who} ({said})", ranks)


def fault_tolerance(env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Whether a rank's death can be survived in this launch, and the reason (for ``mpistrat info``).

    Live: an MPI library with ULFM (Open MPI 5) started with fault tolerance on
    (``mpiexec --with-ft ulfm``, which sets ``OMPI_MCA_mpi_ft_enable``).
    """
    env = os.environ if env is None else env
    library = MPI.Get_library_version()
    if not library.startswith("Open MPI") or not CLASSES:
        name = " ".join(library.split(",")[0].split("\n")[0].split())
        return False, f"{name} has no ULFM; Open MPI 5 launched with `mpiexec --with-ft ulfm` goes on"
    if env.get("OMPI_MCA_mpi_ft_enable", "").lower() not in _TRUE:
        return False, "Open MPI was launched without fault tolerance: add `--with-ft ulfm` to mpiexec"
    transports = env.get("OMPI_MCA_btl", "")
    if not transports or transports.startswith("^") or "sm" in transports.split(","):
        return True, (
            "ULFM (mpiexec --with-ft ulfm); warning: the shared-memory transport was seen to hang after a "
            "death; launch with `--mca pml ob1 --mca btl self,tcp`"
        )
    return True, "ULFM (mpiexec --with-ft ulfm)"


def live() -> bool:
    """:func:`fault_tolerance` of this process's launch (read once): whether the optimizers keep
    their steps all-or-nothing and their sharded slots' copies, so that a death can be survived."""
    global _live
    if _live is None:
        _live = fault_tolerance()[0]
    return _live
