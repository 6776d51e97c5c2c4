"""The file I/O of checkpoints: MPI-IO writes in collective rounds, reads by each rank alone, and
POSIX writes for the background.

Every rank opens the file together (``MPI.File.Open``, with the MPI-IO hints of
:func:`hints`). To write, in each round every rank makes one collective call for its next run
of bytes (``Write_at_all``; a rank with none left passes nothing), so the MPI library may
aggregate where its hints say so. A run in several arrays is one call with a memory datatype
over their addresses, no copy. To read, each rank reads its runs with ``Read_at`` on its own:
a restore reads many small runs (1/R of every window), and reads need no coordination. An error
on one rank never leaves the others waiting: it is kept, the rank takes part in the remaining
rounds with nothing to move, and the caller reports it on every rank afterwards.

A background save writes with ``os.pwritev`` instead: an MPI-IO call holds the MPI library's
lock for the whole transfer (MPICH's global critical section), which would stop the training
step's collectives in the main thread until it returns.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from mpi4py import MPI

from mpistrat import config
from mpistrat.checkpoint.pieces import Piece, joined

__all__ = [
    "DEFAULT_HINTS",
    "described",
    "hints",
    "open_file",
    "os_error",
    "posix_write",
    "read",
    "write_rounds",
]

# MPI error classes and the errno they mean, for an OSError a user can catch like any other.
_ERRNO = {
    MPI.ERR_NO_SPACE: errno.ENOSPC,
    MPI.ERR_QUOTA: errno.EDQUOT,
    MPI.ERR_ACCESS: errno.EACCES,
    MPI.ERR_READ_ONLY: errno.EROFS,
    MPI.ERR_NO_SUCH_FILE: errno.ENOENT,
    MPI.ERR_FILE_EXISTS: errno.EEXIST,
    MPI.ERR_BAD_FILE: errno.EINVAL,
}


# What a file system may answer, as ROMIO passes it on inside an "Other I/O error".
_SAID = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EFBIG)


# Each rank's bytes in a round are one run of its own, so no rank need write another's: the MPI
# standard's hint says so (Open MPI's OMPIO otherwise funnels files under ~32 MB per rank through
# one aggregator; MPICH's ROMIO already writes such runs independently). Sites that want
# aggregation on their file system set it back (``collective_buffering=true,cb_nodes=...``).
DEFAULT_HINTS = {"collective_buffering": "false"}


def hints(extra: dict[str, str] | None) -> dict[str, str]:
    """The MPI-IO hints of a checkpoint: :data:`DEFAULT_HINTS`, ``MPISTRAT_IO_HINTS`` over them,
    then ``extra`` over those. The ranks agree on them before they open a file together."""
    return {**DEFAULT_HINTS, **(config.read("MPISTRAT_IO_HINTS") or {}), **(extra or {})}


def described(io_hints: dict[str, str]) -> tuple[str, str, None]:
    """The hints as a leaf of a save's or a restore's first handshake, which the ranks agree on."""
    return ("MPI-IO hints", str(dict(sorted(io_hints.items()))), None)


def os_error(exc: BaseException, what: str, path: str) -> OSError:
    """``exc`` (an MPI or OS error) as an ``OSError`` saying what failed on which file."""
    if isinstance(exc, OSError):
        return OSError(exc.errno, f"{what}: {exc.strerror or exc}", path)
    if isinstance(exc, MPI.Exception):
        text = exc.Get_error_string().strip()
        code = _ERRNO.get(exc.Get_error_class())
        if code is None:  # ROMIO says "Other I/O error" and the system's words: find the errno there
            code = next((c for c in _SAID if os.strerror(c) in text), errno.EIO)
        return OSError(code, f"{what}: {text.splitlines()[-1] if text else exc}", path)
    return OSError(errno.EIO, f"{what}: {type(exc).__name__}: {exc}", path)


def open_file(
    comm: MPI.Intracomm, path: str, amode: int, io_hints: dict[str, str]
) -> tuple[Any, OSError | None]:
    """``MPI.File.Open`` on every rank of ``comm``: the file, or None and the error (every rank
    gets one: the open is collective and its outcome the same everywhere)."""
    info = MPI.Info.Create()
    try:
        for key, value in io_hints.items():
            info.Set(key, value)
        return MPI.File.Open(comm, path, amode, info), None
    except MPI.Exception as exc:
        return None, os_error(exc, "cannot open the checkpoint file", path)
    finally:
        info.Free()


def write_rounds(fh: Any, calls: list[list[Piece]], rounds: int, path: str) -> OSError | None:
    """``rounds`` collective writes: this rank's calls, then empty ones; the first error, if any."""
    return _rounds(fh.Write_at_all, calls, rounds, path, "writing")


def read(fh: Any, calls: list[list[Piece]], path: str) -> OSError | None:
    """This rank's reads into the pieces' memory, independent of the other ranks; the first error."""
    return _rounds(fh.Read_at, calls, len(calls), path, "reading")


def _rounds(transfer: Any, calls: list[list[Piece]], rounds: int, path: str, doing: str) -> OSError | None:
    error = None
    for k in range(rounds):
        call = calls[k] if k < len(calls) and error is None else []
        if not call and transfer.__name__ == "Read_at":
            continue
        datatype = None
        try:
            if not call:
                transfer(0, [None, 0, MPI.BYTE])
                continue
            buffer: Any = joined([p.memory for p in call])
            if (
                buffer is None
            ):  # one call over several arrays: their addresses in one datatype, nothing copied
                datatype = MPI.BYTE.Create_hindexed(
                    [p.nbytes for p in call], [MPI.Get_address(p.memory) for p in call]
                ).Commit()
                buffer = [MPI.BOTTOM, 1, datatype]
            status = MPI.Status()
            transfer(call[0].offset, buffer, status)
            moved = status.Get_count(MPI.BYTE)
            wanted = sum(p.nbytes for p in call)
            if moved != wanted:  # a read past the end of the file
                raise OSError(errno.EIO, f"{moved} of {wanted} bytes at offset {call[0].offset}")
        except (MPI.Exception, OSError) as exc:
            error = error or os_error(exc, f"{doing} the checkpoint file", path)
        finally:
            if datatype is not None:
                datatype.Free()
    return error


def posix_write(path: str, header: bytes, calls: list[list[Piece]]) -> None:
    """Write ``header`` (rank 0's, or empty) and this rank's calls with POSIX I/O, then fsync."""
    fd = os.open(path, os.O_WRONLY)
    try:
        if header:
            _pwritev(fd, [memoryview(header)], 0)
        for call in calls:
            _pwritev(fd, [p.memory.data for p in call], call[0].offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwritev(fd: int, buffers: list[memoryview], offset: int) -> None:
    """All of ``buffers`` at ``offset`` (``pwritev`` may write less than asked: go on from there)."""
    while buffers:
        done = os.pwritev(fd, buffers, offset)
        if not done:
            raise OSError(errno.EIO, f"pwritev wrote nothing at offset {offset}")
        offset += done
        while buffers and done >= buffers[0].nbytes:
            done -= buffers[0].nbytes
            buffers = buffers[1:]
        if buffers and done:
            buffers[0] = buffers[0][done:]
