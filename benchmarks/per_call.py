"""Microseconds per ``all_reduce`` call, best of repeats: a tighter before/after check than a sweep.

Run it under ``mpiexec`` once per version, alternating, with ``PYTHONPATH`` pointing at each
source tree; rank 0 prints the best mean over ``--repeats`` loops of ``--calls`` calls:

    for i in 1 2 3 4; do for tree in /tmp/before .; do
        PYTHONPATH=$tree mpiexec -n 2 python -m benchmarks.per_call --bytes 4; done; done
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import mpistrat


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bytes", type=int, default=4, help="float32 bytes per call (default 4)")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    strategy = mpistrat.MPIStrategy()
    x = np.ones(max(1, args.bytes // 4), np.float32)

    def loop() -> float:
        ctx = mpistrat.get_replica_context()
        for _ in range(args.calls // 2):  # warm-up
            ctx.all_reduce("sum", x)
        best = float("inf")
        for _ in range(args.repeats):
            MPI.COMM_WORLD.Barrier()
            began = time.perf_counter()
            for _ in range(args.calls):
                ctx.all_reduce("sum", x)
            best = min(best, (time.perf_counter() - began) / args.calls)
        return best

    best = strategy.run(loop)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"{mpistrat.__file__}: {x.nbytes} B all_reduce, {best * 1e6:.1f} us per call")


if __name__ == "__main__":
    main()
