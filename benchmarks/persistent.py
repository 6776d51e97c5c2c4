"""Persistent against plain and non-blocking all-reduce, raw mpi4py: what ``Allreduce_init`` would gain.

    mpiexec -n 2 python -m benchmarks.persistent [--repeat 5]

For 4 B to 1 MiB of float32 summed in place: ``Allreduce`` (plain), ``Allreduce_init`` once then
``Start`` and ``Wait`` per call (persistent, MPI-4, mpi4py 4), and ``Iallreduce`` then ``Wait``
(non-blocking). Microseconds per call, the median of ``--repeat`` blocks, on rank 0's clock.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    if comm.Get_rank() == 0:
        print(f"ranks {comm.Get_size()}, {MPI.Get_library_version().splitlines()[0]}")
        print(f"{'bytes':>8} {'plain us':>9} {'persistent us':>14} {'non-blocking us':>16}")
    for n in (1, 256, 16384, 262144):
        buf = np.ones(n, np.float32)
        persistent = (
            comm.Allreduce_init(MPI.IN_PLACE, buf, MPI.SUM) if hasattr(comm, "Allreduce_init") else None
        )
        calls = 2000 if n < 100_000 else 200
        steps = {
            "plain": lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),  # noqa: B023
            "non-blocking": lambda: comm.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM).Wait(),  # noqa: B023
        }
        if persistent is not None:
            steps["persistent"] = lambda: (persistent.Start(), persistent.Wait())  # noqa: B023
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.repeat):
            for name, step in steps.items():
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    step()
                times[name].append((time.perf_counter() - start) / calls * 1e6)
        if persistent is not None:
            persistent.Free()
        if comm.Get_rank() == 0:
            med = {name: statistics.median(values) for name, values in times.items()}
            kept = f"{med['persistent']:14.2f}" if "persistent" in med else f"{'(none)':>14}"
            print(f"{n * 4:>8} {med['plain']:9.2f} {kept} {med['non-blocking']:16.2f}")
    comm.Free()


if __name__ == "__main__":
    main()
