"""What a save's guarantees cost over raw MPI-IO, each part alone:

    mpiexec -n 2 python -m benchmarks.save_parts --params 16M --rounds 15 --dir /tmp/bench

A model of ``--params`` float32 parameters in 16 variables with Adam (sharded with ``--shard``),
saved in interleaved rounds, each into a new file renamed into place as a save does, by: ``raw``
(``Write_at_all`` of 1/R of the file's bytes from a buffer kept between rounds, ``Sync``); ``raw,
durable`` (the same, the rename then made durable by an fsync of the folder, as a save's is);
``layout`` (this rank's pieces of the checkpoint as ``Checkpoint.write`` lays them out, through the
same MPI-IO calls: a view over its runs, ``Write_at_all``, ``Sync``); ``checksum line`` and
``checksum thread`` (the layout and the CRC-32C of its pieces and of the rest of its copies of the
values every rank holds, before the write or in a thread beside it); ``checksum in Sync`` (the same
in a thread started after the write, while ``Sync`` waits for the disk; rank 0 then writes the
header and flushes it alone); ``begin`` (``saving.begin`` alone: the agreements, the layout, the
file created and its header written, then closed and removed); ``Checkpoint.write`` and its phases
(``begin``, the collective writes, the rest of ``saving.write``: ``Sync`` and the checksums waited
for; ``finish``: the errors and checksums gathered, rank 0's header written and flushed, the rename,
the folder's fsync). Reported: the median over rounds of the slowest rank's time, its ratio to raw,
and rank 0's CPU time (user + system, every thread) per round.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from benchmarks.checkpoint_rounds import adam_checkpoint, arguments, interleaved, report
from mpistrat.checkpoint import crc, mpiio, saving

PHASES = ("  begin", "  writes", "  Sync, checksums", "  finish")


def main() -> None:
    args = arguments(__doc__)
    model = adam_checkpoint(args)
    comm, ckpt, path, folder = model.comm, model.checkpoint, model.path, model.folder
    rank, size = comm.Get_rank(), comm.Get_size()
    collectives = model.strategy.extended.collectives
    nbytes = os.path.getsize(path)
    lo, hi = nbytes * rank // size, nbytes * (rank + 1) // size
    kept = np.full(hi - lo, rank % 251, np.uint8)
    hints = mpiio.hints(None)
    plan = saving.begin(ckpt._entries(), collectives, path, "write", 0, None)  # this rank's pieces
    calls, rounds = plan.calls, plan.rounds
    saving.close(plan)
    if rank == 0:
        os.remove(plan.tmp)
    pieces = [piece for call in calls for piece in call]
    target = os.path.join(folder, "parts")

    def written(
        write: Callable[[Any], None], durable: bool = False, after: Callable[[], None] | None = None
    ) -> None:
        """``write(fh)`` into a new file, ``Sync``, ``Close``, ``after()``, renamed into place by
        rank 0 (and the rename made durable, the folder's fsync, if ``durable``)."""
        fh, error = mpiio.open_file(comm, target + ".tmp", MPI.MODE_CREATE | MPI.MODE_WRONLY, hints)
        assert fh is not None, error
        write(fh)
        fh.Sync()
        fh.Close()
        if after is not None:
            after()
        if rank == 0:
            os.replace(target + ".tmp", target)
            if durable:
                fd = os.open(folder, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        comm.Barrier()

    def raw(fh: Any) -> None:
        fh.Write_at_all(lo, kept)

    def layout(fh: Any) -> None:
        assert mpiio.write_rounds(fh, calls, rounds, target) is None

    def checksums() -> object:
        return crc.records(pieces), crc.records(plan.others)

    def checksum_line(fh: Any) -> None:
        checksums()
        layout(fh)

    def checksum_thread(fh: Any) -> None:
        work = crc.in_thread(checksums)
        layout(fh)
        work.result()

    during: list[Any] = []

    def checksum_during_sync(fh: Any) -> None:  # the thread runs while Sync waits for the disk
        layout(fh)
        during.append(crc.in_thread(checksums))

    def header_after() -> None:  # the checksums gathered, rank 0 writes the header and flushes it
        comm.gather(during.pop().result())
        if rank == 0:
            fd = os.open(target + ".tmp", os.O_WRONLY)
            os.pwrite(fd, plan.header, 0)
            os.fsync(fd)
            os.close(fd)

    def begin() -> None:
        save = saving.begin(ckpt._entries(), collectives, target, "write", 0, None)
        saving.close(save)
        if rank == 0:
            os.remove(save.tmp)

    phase = _Phases()
    sides: dict[str, Callable[[], object]] = {
        "raw": lambda: written(raw),
        "raw, durable": lambda: written(raw, durable=True),
        "layout": lambda: written(layout),
        "checksum line": lambda: written(checksum_line),
        "checksum thread": lambda: written(checksum_thread),
        "checksum in Sync": lambda: written(checksum_during_sync, after=header_after),
        "begin": begin,
        "Checkpoint.write": lambda: phase.timed(lambda: ckpt.write(path)),
    }
    phases: dict[str, list[float]] = {k: [] for k in PHASES}

    def phases_of(name: str) -> None:
        if name == "Checkpoint.write":
            for k, seconds in zip(PHASES, phase.last, strict=True):
                phases[k].append(comm.allreduce(seconds, op=MPI.MAX))

    times, cpu = interleaved(comm, sides, args.rounds, after=phases_of)
    report(model, args, times | phases, cpu)


class _Phases:
    """The seconds of each of :data:`PHASES` in the last ``Checkpoint.write`` timed, on this rank."""

    def __init__(self) -> None:
        self.last: list[float] = [0.0] * len(PHASES)

    def timed(self, save: Callable[[], object]) -> None:
        clock: dict[str, float] = {}

        def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def timed_fn(*a: Any, **k: Any) -> Any:
                start = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    clock[name] = clock.get(name, 0.0) + time.perf_counter() - start

            return timed_fn

        originals = (saving.begin, saving.write, saving.finish, mpiio.write_rounds)
        saving.begin, saving.write, saving.finish, mpiio.write_rounds = (
            wrap(n, f) for n, f in zip(("begin", "write", "finish", "writes"), originals, strict=True)
        )
        try:
            save()
        finally:
            saving.begin, saving.write, saving.finish, mpiio.write_rounds = originals
        with contextlib.suppress(KeyError):
            self.last = [clock["begin"], clock["writes"], clock["write"] - clock["writes"], clock["finish"]]


if __name__ == "__main__":
    main()
