"""Persistent collectives (MPI-4 ``Allreduce_init``) against plain ``Allreduce``, from Python.

    mpiexec -n 2 python -m benchmarks.persistent [--sizes 4 4K 64K 1M] [--iters 2000] [--repeats 7]

The optimizer's step reduces the same buffers every step, which is what a persistent request
is for: the MPI library plans the collective once (``Allreduce_init``), and each step is
``Start`` + ``Wait``. This times, per float32 buffer size, an in-place ``Allreduce`` and the
persistent request's ``Start`` + ``Wait`` on the same buffer, interleaved, and prints rank 0's
best mean in microseconds. A library without MPI-4 persistent collectives prints that instead.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from mpistrat.tools.sizes import parse_size


def per_call(comm: MPI.Intracomm, call: Callable[[], object], iters: int) -> float:
    comm.Barrier()
    began = time.perf_counter()
    for _ in range(iters):
        call()
    return comm.allreduce(time.perf_counter() - began, op=MPI.MAX) / iters


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=["4", "4K", "64K", "1M"])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    library = MPI.Get_library_version().splitlines()[0].strip()
    if not hasattr(comm, "Allreduce_init"):
        if comm.Get_rank() == 0:
            print(f"{library}: mpi4py has no Allreduce_init (needs mpi4py 4 and an MPI-4 library)")
        return
    rows = []
    for size in args.sizes:
        buf = np.ones(max(1, parse_size(size) // 4), np.float32)
        try:
            request = comm.Allreduce_init(MPI.IN_PLACE, buf, op=MPI.SUM)
        except NotImplementedError:
            if comm.Get_rank() == 0:
                print(f"{library}: no persistent collectives")
            return

        def plain(buf: np.ndarray = buf) -> None:
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

        def persistent(request: MPI.Prequest = request) -> None:
            request.Start()
            request.Wait()

        iters = max(10, args.iters * 4096 // max(buf.nbytes, 4096))
        best = {"Allreduce": float("inf"), "Allreduce_init Start+Wait": float("inf")}
        for call in (plain, persistent):  # warm
            per_call(comm, call, 20)
        for _ in range(args.repeats):
            best["Allreduce"] = min(best["Allreduce"], per_call(comm, plain, iters))
            best["Allreduce_init Start+Wait"] = min(
                best["Allreduce_init Start+Wait"], per_call(comm, persistent, iters)
            )
        request.Free()
        rows.append((buf.nbytes, best))
    if comm.Get_rank() == 0:
        print(f"{comm.Get_size()} ranks, {library}, best of {args.repeats}")
        print(f"{'bytes':>9s} {'Allreduce us':>13s} {'persistent us':>14s} {'ratio':>6s}")
        for nbytes, best in rows:
            a, p = best["Allreduce"], best["Allreduce_init Start+Wait"]
            print(f"{nbytes:9d} {a * 1e6:13.2f} {p * 1e6:14.2f} {p / a:6.2f}")


if __name__ == "__main__":
    main()
