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

import argparse
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.checkpoint.crc import CRC32C
from mpistrat.tools.sizes import parse_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=parse_size, default=16 << 20, help="float32 parameters (default 16M)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--shard", action="store_true")
    p.add_argument(
        "--dir", default=None, help="where the file goes (default: a new folder in the current one)"
    )
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    strategy = mpistrat.MPIStrategy()
    per_variable = args.params // 16
    with strategy.scope():
        ws = [mpistrat.Variable(np.full(per_variable, 0.5, np.float32), name=f"w{i}") for i in range(16)]
        opt = mpistrat.optimizers.Adam(1e-3, shard_state=args.shard)
        opt.build(ws)
    folder = comm.bcast(tempfile.mkdtemp(dir=args.dir or os.getcwd()) if rank == 0 else None)
    ckpt = mpistrat.Checkpoint(model=ws, opt=opt)
    path = ckpt.write(os.path.join(folder, "ckpt"))
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
    times: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(args.rounds + 1):  # the first round warms up
        names = list(sides)
        for name in names[i % len(names) :] + names[: i % len(names)]:
            comm.Barrier()
            used, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            sides[name]()
            elapsed, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
            if i:
                times[name].append(comm.allreduce(elapsed, op=MPI.MAX))
                cpu[name].append(after.ru_utime - used.ru_utime + after.ru_stime - used.ru_stime)
    comm.Barrier()
    if rank == 0:
        base = statistics.median(times["raw"])
        print(f"{size} ranks, {os.path.getsize(path) / 2**20:.0f} MiB, load {os.getloadavg()[0]:.1f}")
        print(f"{'':>16} {'ms':>8} {'x raw':>6} {'CPU ms':>7}")
        for name in sides:
            t = statistics.median(times[name])
            print(f"{name:>16} {t * 1e3:8.1f} {t / base:6.2f} {statistics.median(cpu[name]) * 1e3:7.1f}")
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)


if __name__ == "__main__":
    main()
