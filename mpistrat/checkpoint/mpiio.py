"""The file I/O of checkpoints: MPI-IO writes in collective rounds, reads by each rank alone, and
POSIX writes for the background.

Every rank opens the file together (``MPI.File.Open``, with the MPI-IO hints of
:func:`hints`). To write, in each round every rank makes one collective call for its next
pieces (a rank with none left passes nothing). Where the MPI-IO layer writes the runs of a file
view as they are (:data:`VIEWS`: MPICH's ROMIO, Open MPI's OMPIO) a call covers however many
runs of the file (``Set_view`` over them, then ``Write_at_all``), so a save is one round unless
a rank writes more than ``CALL_LIMIT`` bytes; elsewhere (Intel MPI) a call is one run. Pieces in
several arrays are one call with a memory datatype over their addresses, no copy. To read, each
rank reads its runs with ``Read_at`` on its own: a restore reads 1/R of every window, and reads
need no coordination. An error on one rank never leaves the others waiting: it is kept, the rank
takes part in the remaining rounds with nothing to move, and the caller reports it on every rank
afterwards.

A background save writes with ``os.pwritev`` instead: an MPI-IO call holds the MPI library's
lock for the whole transfer (MPICH's global critical section), which would stop the training
step's collectives in the main thread until it returns.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from mpistrat import config
from mpistrat.checkpoint import pieces
from mpistrat.checkpoint.pieces import Piece, joined

__all__ = [
    "DEFAULT_HINTS",
    "VIEWS",
    "described",
    "hints",
    "open_file",
    "os_error",
    "posix_write",
    "read",
    "write_calls",
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


# Each rank writes its own runs, on every MPI family: they are large and no other rank's bytes lie
# inside one, so an aggregator would only add a copy of every byte to it. Each family reads its own
# key and ignores the others': Open MPI's OMPIO the standard's ``collective_buffering`` (else it
# funnels files under ~32 MB per rank through one aggregator); ROMIO (MPICH, Intel MPI, Open MPI
# with ``--mca io romio341``) does not read that one and gathers to ``cb_nodes`` (one per node)
# whenever the ranks' runs interleave, as a view over several runs does: ``romio_cb_write=disable``
# turns that off, and ``romio_ds_write=disable`` its data sieving, which would rewrite the bytes
# between a rank's runs (other ranks') under a lock. Sites that want aggregation set the hints back
# (``MPISTRAT_IO_HINTS=romio_cb_write=enable,cb_nodes=...``); docs/performance.md has both measured.
DEFAULT_HINTS = {"collective_buffering": "false", "romio_cb_write": "disable", "romio_ds_write": "disable"}


# Whether a write call may see the file through a view of several runs. Intel MPI's ROMIO
# data-sieves every such view whatever ``romio_ds_write`` says: it reads and rewrites the other
# ranks' bytes between a rank's runs in 512 KiB blocks under fcntl locks (1.08x the share at 3
# ranks, counted). There each run is a call of its own, which every MPI-IO layer writes as it is.
VIEWS = not MPI.Get_library_version().startswith("Intel")


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


def write_calls(mine: list[Piece]) -> list[list[Piece]]:
    """This rank's pieces grouped into its collective write calls (:data:`VIEWS` says how)."""
    return pieces.rounds(mine) if VIEWS else pieces.calls(mine)


def write_rounds(fh: Any, calls: list[list[Piece]], rounds: int, path: str) -> OSError | None:
    """``rounds`` collective writes: this rank's calls, then empty ones (with :data:`VIEWS`, each
    through a view of its runs, and the file's view is the whole file again afterwards). The first
    error, if any."""
    error = None
    for k in range(rounds):
        call = calls[k] if k < len(calls) and error is None else []
        try:
            if VIEWS:
                _write_through_view(fh, call)
            else:
                _write_run(fh, call)
        except (MPI.Exception, OSError) as exc:
            error = error or os_error(exc, "writing the checkpoint file", path)
    if rounds and VIEWS:
        try:
            fh.Set_view(0, MPI.BYTE, MPI.BYTE)
        except MPI.Exception as exc:
            error = error or os_error(exc, "writing the checkpoint file", path)
    return error


def _write_through_view(fh: Any, call: list[Piece]) -> None:
    """One ``Set_view`` over the runs of ``call``'s pieces and one ``Write_at_all`` of them
    (collective: every rank makes both calls, a rank with nothing, or whose view failed, writes
    nothing)."""
    view = memory = failed = None
    buffer: Any = [None, 0, MPI.BYTE]
    runs = [(run[0].offset, sum(p.nbytes for p in run)) for run in pieces.calls(call)]
    try:
        if call:
            view = MPI.BYTE.Create_hindexed([n for _, n in runs], [at for at, _ in runs]).Commit()
        fh.Set_view(0, MPI.BYTE, view or MPI.BYTE)
        if call:
            buffer = _memory(call)
            if buffer is None:  # pieces of several arrays: their addresses in one datatype, nothing copied
                memory = _addresses(call)
                buffer = [MPI.BOTTOM, 1, memory]
    except MPI.Exception as exc:
        failed, buffer, runs = exc, [None, 0, MPI.BYTE], []
    try:
        _check_count(fh.Write_at_all, 0, buffer, sum(n for _, n in runs), runs[0][0] if runs else 0)
    finally:
        for datatype in (view, memory):
            if datatype is not None:
                datatype.Free()
    if failed is not None:
        raise failed


def _write_run(fh: Any, call: list[Piece]) -> None:
    """One ``Write_at_all`` of ``call``'s pieces, one run of the file (collective: a rank with nothing
    passes an empty call)."""
    if not call:
        fh.Write_at_all(0, [None, 0, MPI.BYTE])
        return
    _transfer(fh.Write_at_all, call)


def read(
    fh: Any, calls: list[list[Piece]], path: str, then: Callable[[list[Piece]], None] | None = None
) -> OSError | None:
    """This rank's reads into the pieces' memory, independent of the other ranks, each call one run
    of the file; ``then(call)`` after each (its checksum, while the next is read). The first error."""
    for call in calls:
        try:
            _transfer(fh.Read_at, call)
        except (MPI.Exception, OSError) as exc:
            return os_error(exc, "reading the checkpoint file", path)
        if then is not None:
            then(call)
    return None


def _transfer(transfer: Any, call: list[Piece]) -> None:
    """``transfer`` (``Read_at``, ``Write_at_all``) of ``call``'s pieces, one run of the file."""
    memory = None
    try:
        buffer = _memory(call)
        if buffer is None:  # pieces of several arrays: their addresses in one datatype, nothing copied
            memory = _addresses(call)
            buffer = [MPI.BOTTOM, 1, memory]
        at = call[0].offset
        _check_count(transfer, at, buffer, sum(p.nbytes for p in call), at)
    finally:
        if memory is not None:
            memory.Free()


def _memory(call: list[Piece]) -> Any:
    """The pieces' memory as one buffer when it lies end to end, else None."""
    return joined([p.memory for p in call])


def _addresses(call: list[Piece]) -> Any:
    """A datatype over the pieces' memory at its addresses (to pass with ``MPI.BOTTOM``)."""
    lengths, addresses = [p.nbytes for p in call], [MPI.Get_address(p.memory) for p in call]
    return MPI.BYTE.Create_hindexed(lengths, addresses).Commit()


def _check_count(transfer: Any, offset: int, buffer: Any, wanted: int, where: int) -> None:
    status = MPI.Status()
    transfer(offset, buffer, status)
    moved = status.Get_count(MPI.BYTE)
    if moved != wanted:  # a read past the end of the file, a short write
        raise OSError(errno.EIO, f"{moved} of {wanted} bytes at offset {where}")


def posix_write(path: str, header: bytes, calls: list[list[Piece]]) -> None:
    """Write ``header`` (rank 0's, or empty) and this rank's calls with POSIX I/O, then fsync."""
    fd = os.open(path, os.O_WRONLY)
    try:
        if header:
            _pwritev(fd, [memoryview(header)], 0)
        for run in pieces.calls([p for call in calls for p in call]):
            _pwritev(fd, [p.memory.data for p in run], run[0].offset)
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
