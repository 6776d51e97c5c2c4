"""The memory each ``mpistrat bench`` op holds while it times one size, in multiples of that size.

``Op.footprint`` in ``mpistrat/tools/bench_ops.py`` holds these numbers rounded up; ``mpistrat
bench`` checks its largest size against them before the sweep. Peak bytes traced by
``tracemalloc`` (NumPy's buffers included) while the case is built and timed::

    mpiexec -n 1 python -m benchmarks.bench_footprint
    mpiexec -n 2 python -m benchmarks.bench_footprint --size 16MiB
"""

from __future__ import annotations

import argparse
import tempfile
import tracemalloc

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.tools import bench, bench_args
from mpistrat.tools.bench_ops import OPS, Setup
from mpistrat.tools.sizes import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=parse_size, default=16 << 20)
    size = parser.parse_args().size
    world = MPI.COMM_WORLD
    comm = world.Dup()
    strategy = mpistrat.MPIStrategy(world)
    args = bench_args.parser().parse_args(["--iters", "3", "--min-iters", "3"])
    with tempfile.TemporaryDirectory() as directory:
        for name, op in OPS.items():
            setup = Setup(strategy, comm, np.dtype("float32"), size, 64, 256, "weak", False, 0.0, directory)
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            bench._run_case(strategy, name, setup, args, set())
            peak = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
            comm.Barrier()
            for cleanup in setup.cleanups:
                cleanup()
            if world.Get_rank() == 0:
                declared = op.bytes_needed(size, world.Get_size()) / size
                print(f"{name:22s} {peak / size:5.1f} x size (declared {declared:g})")


if __name__ == "__main__":
    main()
