"""What a restore's guarantees cost over raw MPI-IO, each part alone:

    mpiexec -n 2 python -m benchmarks.restore_parts --params 16M --rounds 15 --dir /tmp/bench

A model of ``--params`` float32 parameters in 16 variables with Adam (sharded with ``--shard``),
saved once, then restored in interleaved rounds by: ``raw`` (``Read_at_all`` of 1/R of the file
into a buffer kept between rounds, one ``Allgather`` of the whole); ``new buffer`` (the same into a
buffer allocated each time, as a restore that keeps the variables as they were until the bytes are
checked must); ``checksum`` (raw and the CRC-32C of the share); ``checked`` (both, the checksums
shared before the ``Allgather``: the least a restore with mpistrat's guarantees does);
``Checkpoint.read``. Reported: the median over rounds of the slowest rank's time, its ratio to raw,
and this rank's CPU time (user + system, every thread) per round, rank 0's.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from benchmarks.checkpoint_rounds import adam_checkpoint, arguments, interleaved, report
from mpistrat.checkpoint.crc import CRC32C


def main() -> None:
    args = arguments(__doc__)
    model = adam_checkpoint(args)
    comm, ckpt, path = model.comm, model.checkpoint, model.path
    rank, size = comm.Get_rank(), comm.Get_size()
    share = -(-os.path.getsize(path) // size)
    kept, whole = np.empty(share, np.uint8), np.empty(share * size, np.uint8)

    def raw(buffer: np.ndarray | None = None, checksum: bool = False) -> None:
        mine = kept if buffer is None else buffer
        fh = MPI.File.Open(comm, path, MPI.MODE_RDONLY)
        fh.Read_at_all(rank * share, mine)
        fh.Close()
        if checksum:
            comm.allgather(CRC32C(mine.data))
        comm.Allgather(mine, whole)

    sides: dict[str, Callable[[], object]] = {
        "raw": raw,
        "new buffer": lambda: raw(np.empty(share, np.uint8)),
        "checksum": lambda: raw(checksum=True),
        "checked": lambda: raw(np.empty(share, np.uint8), checksum=True),
        "Checkpoint.read": lambda: ckpt.read(path),
    }
    times, cpu = interleaved(comm, sides, args.rounds)
    report(model, args, times, cpu)


if __name__ == "__main__":
    main()
