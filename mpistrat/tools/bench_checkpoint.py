"""The checkpoint operations ``mpistrat bench`` measures: a save and a restore of a model with Adam,
each next to raw MPI-IO moving the same bytes, bare (``raw``) and with the same guarantees (``raw2``).

The state is ``P = nbytes / itemsize`` parameters in ``s.leaves`` variables and Adam's two slots
(sharded with ``--shard``): a file of about ``3 nbytes``. ``raw`` saves as a hand-written
parallel writer would: every rank writes its 1/R of the file's bytes with one ``Write_at_all``,
``Sync``, and rank 0 renames the file into place; ``raw2`` as one that keeps a save's guarantees
must: each rank also checksums its share (CRC-32C, gathered to rank 0, which a header would
hold), and rank 0 makes the rename durable (an fsync of the folder, so that a crash after the
save returns cannot bring the previous file back). After each save, untimed, rank 0 waits for
the replaced file's removal (``Checkpoint.write`` leaves it to a thread) and flushes the file
systems (``os.sync``): what a side leaves to the next commit (raw's rename, the blocks of the file
it replaced) or to a thread is charged to no side, as in a job whose saves are minutes apart.

``raw`` restores with one ``Read_at_all`` of 1/R and one ``Allgather`` of the whole; ``raw2`` as a
hand-written restore that keeps a restore's guarantees must: it reads into a buffer of its own (the
variables keep their values until the bytes are checked), checksums it (CRC-32C) and shares the
checksums before the ``Allgather``. The files go to ``--checkpoint-dir`` (default: a new folder in
the current directory, on the file system a job would use), removed afterwards.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.checkpoint import files
from mpistrat.checkpoint.crc import CRC32C
from mpistrat.tools.bench_case import Case, Check, Setup, split

__all__ = ["checkpoint_restore", "checkpoint_save", "io_factor"]


def io_factor(n: int) -> float:
    """busbw of the checkpoint ops: bytes per rank (algbw is the file's bytes over the time)."""
    return 1.0 / n


class _Model:
    """Variables holding ``P`` parameters and an Adam optimizer whose slots exist (one step taken)."""

    def __init__(self, s: Setup):
        dtype = s.dtype if s.dtype.kind == "f" else np.dtype(np.float32)
        count = max(s.leaves, s.nbytes // dtype.itemsize)
        bounds = np.cumsum([0, *split(count, s.leaves)]).tolist()
        self.initial = (np.arange(count) % 7).astype(dtype)
        with s.strategy.scope():
            self.variables = [
                mpistrat.Variable(self.initial[a:b], name=f"layer{i:03d}")
                for i, (a, b) in enumerate(itertools.pairwise(bounds))
            ]
            self.opt = mpistrat.optimizers.Adam(1e-3, shard_state=s.shard)
            self.opt.build(self.variables)
        self.checkpoint = mpistrat.Checkpoint(model=self.variables, opt=self.opt)
        self.count, self.dtype = count, dtype


def _directory(s: Setup) -> str:
    """A new folder for this case's files (rank 0's, in ``s.directory`` or the current directory)."""
    where = None
    if s.rank == 0:
        parent = s.directory or os.getcwd()
        os.makedirs(parent, exist_ok=True)
        where = tempfile.mkdtemp(prefix="mpistrat-bench-checkpoint-", dir=parent)
    folder: str = s.comm.bcast(where, root=0)

    def remove() -> None:  # on every rank, so that every rank knows there is something to clean up
        if s.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)

    s.cleanups.append(remove)
    return folder


def _raw_save(s: Setup, path: str, nbytes: int, checked: bool = False) -> Any:
    """Every rank writes its 1/R of ``nbytes`` with one collective call, syncs; rank 0 renames.
    ``checked``: each rank's CRC-32C gathered to rank 0 first, and the rename made durable (an
    fsync of the folder), as a save's guarantees need."""
    lo, hi = nbytes * s.rank // s.size, nbytes * (s.rank + 1) // s.size
    mine = np.full(hi - lo, s.rank % 251, np.uint8)
    comm, tmp = s.comm, path + ".tmp"

    def save() -> int:
        fh = MPI.File.Open(comm, tmp, MPI.MODE_CREATE | MPI.MODE_WRONLY)
        fh.Write_at_all(lo, mine)
        if checked:
            comm.gather(CRC32C(mine.data))
        fh.Sync()
        fh.Close()
        if s.rank == 0:
            os.replace(tmp, path)
            if checked:
                folder = os.open(os.path.dirname(path), os.O_RDONLY)
                os.fsync(folder)
                os.close(folder)
        comm.Barrier()
        return os.path.getsize(path)

    return save


def checkpoint_save(s: Setup) -> Case:
    """``Checkpoint.write`` of the model, raw MPI-IO writing as many bytes, and raw MPI-IO checked
    (the CRC-32C of each share gathered, the rename made durable)."""
    model, folder = _Model(s), _directory(s)
    path = os.path.join(folder, "mpistrat")
    model.checkpoint.write(path)
    nbytes = os.path.getsize(path)

    def save() -> int:
        model.checkpoint.write(path)
        return os.path.getsize(path)

    def written(size: int) -> bool:
        return size == nbytes

    sides: dict[str, tuple[Callable[[], Any], Check]] = {
        "mpistrat": (save, written),
        "raw": (_raw_save(s, os.path.join(folder, "raw"), nbytes), written),
        "raw2": (_raw_save(s, os.path.join(folder, "raw2"), nbytes, checked=True), written),
    }
    return Case(nbytes, model.count, s.leaves, sides, settle=_flush(s))


def _flush(s: Setup) -> Callable[[], None]:
    def flush() -> None:
        if s.rank == 0:
            files.wait_for_removals()
            os.sync()

    return flush


def checkpoint_restore(s: Setup) -> Case:
    """``Checkpoint.read`` of the model, raw MPI-IO (``Read_at_all`` of 1/R, ``Allgather``) and raw
    MPI-IO checked (into a new buffer, its CRC-32C shared, then the ``Allgather``)."""
    model, folder = _Model(s), _directory(s)
    path = model.checkpoint.write(os.path.join(folder, "mpistrat"))
    nbytes = os.path.getsize(path)
    comm = s.comm
    per = -(-nbytes // s.size)
    mine, whole = np.empty(per, np.uint8), np.empty(per * s.size, np.uint8)
    whole2 = np.empty_like(whole)
    first = model.variables[0]
    want = model.initial[: first.shape[0]]
    at = files.read_table(path).entries["model/0"].offset  # type: ignore[union-attr]

    def restore() -> bool:
        model.checkpoint.read(path)
        return True

    def raw() -> bool:
        fh = MPI.File.Open(comm, path, MPI.MODE_RDONLY)
        fh.Read_at_all(s.rank * per, mine)
        fh.Close()
        comm.Allgather(mine, whole)
        return True

    def checked() -> list[int]:
        share = np.empty(per, np.uint8)  # new memory, as a restore's must be
        fh = MPI.File.Open(comm, path, MPI.MODE_RDONLY)
        fh.Read_at_all(s.rank * per, share)
        fh.Close()
        crcs: list[int] = comm.allgather(CRC32C(share.data))
        comm.Allgather(share, whole2)
        return crcs

    def checked_back(crcs: list[int]) -> bool:
        got = [CRC32C(whole2[r * per : (r + 1) * per].data) for r in range(s.size)]
        return crcs == got and bool(np.array_equal(whole2[at : at + want.nbytes].view(want.dtype), want))

    def restored(_: bool) -> bool:
        return bool(np.array_equal(np.asarray(first), want))

    def read_back(_: bool) -> bool:
        return bool(np.array_equal(whole[at : at + want.nbytes].view(want.dtype), want))

    sides: dict[str, tuple[Callable[[], Any], Check]] = {
        "mpistrat": (restore, restored),
        "raw": (raw, read_back),
        "raw2": (checked, checked_back),
    }
    return Case(nbytes, model.count, s.leaves, sides)
