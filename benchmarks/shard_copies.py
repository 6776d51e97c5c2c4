"""What the keepers of a sharded optimizer cost when nothing fails: the step with and without them.

    mpiexec --with-ft ulfm --mca pml ob1 --mca btl self,tcp -n 4 python -m benchmarks.shard_copies
    mpiexec -n 4 python -m benchmarks.shard_copies          # any MPI: the copies are plain Sendrecv

One ``Adam(shard_state=True)`` step over ``--sizes`` float32 parameters (one variable), where a
rank's death is survivable (each rank sends its keeper its block of the summed gradients, sets its
own part aside before the update, and replays its partner's update: ``training/shard_copies.py``)
and where it is not, interleaved, ``--repeats`` times ``--steps`` steps; beside them the raw
mpi4py ``Reduce_scatter_block`` + ``Allgather`` of the same buffer. Rank 0 prints milliseconds per
step (median, best) and the median ratio of the step with copies to the step without.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.diagnostics import ulfm


def per_step(comm: MPI.Intracomm, run: Callable[[], object], steps: int) -> float:
    comm.Barrier()
    began = time.perf_counter()
    for _ in range(steps):
        run()
    return comm.allreduce(time.perf_counter() - began, op=MPI.MAX) / steps * 1e3


def variants(comm: MPI.Intracomm, strategy: mpistrat.MPIStrategy, n: int) -> dict[str, Callable[[], object]]:
    """The step with the keepers, without them, and the raw transfers of one, over ``n`` parameters."""
    grad = np.random.default_rng(comm.Get_rank()).standard_normal(n).astype(np.float32)
    steps: dict[str, Callable[[], object]] = {}
    for kept in (False, True):
        with strategy.scope():
            w = mpistrat.Variable(np.zeros(n, np.float32))
            opt = mpistrat.optimizers.Adam(1e-3, shard_state=True)

        def step(opt: Any = opt, w: Any = w, kept: bool = kept) -> None:
            ulfm._live = kept
            strategy.run(lambda: opt.apply_gradients([(grad, w)]))

        steps["with keepers" if kept else "without"] = step
    size = comm.Get_size()
    buf = np.zeros(-(-n // size) * size, np.float32)
    part = np.empty(buf.size // size, np.float32)

    def raw() -> None:
        comm.Reduce_scatter_block(buf, part)
        comm.Allgather(part, buf)

    steps["raw mpi4py rs + allgather"] = raw
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 22])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    strategy = mpistrat.MPIStrategy()
    if comm.Get_rank() == 0:
        print(f"{comm.Get_size()} ranks, {MPI.Get_library_version().splitlines()[0]}")
        print(f"{'parameters':>11s} {'variant':28s} {'median ms':>9s} {'best ms':>8s}")
    for n in args.sizes:
        steps = variants(comm, strategy, n)
        samples: dict[str, list[float]] = {name: [] for name in steps}
        for run in steps.values():
            run()  # the first step builds (and makes the copies whole)
        for _ in range(args.repeats):  # interleaved: a slow moment of a shared machine hits every variant
            for name, run in steps.items():
                samples[name].append(per_step(comm, run, args.steps))
        if comm.Get_rank() == 0:
            for name, v in samples.items():
                print(f"{n:11d} {name:28s} {statistics.median(v):9.2f} {min(v):8.2f}")
            kept, plain = samples["with keepers"], samples["without"]
            ratio = statistics.median(a / b for a, b in zip(kept, plain, strict=True))
            print(f"{n:11d} {'with / without':28s} {ratio:9.3f}")


if __name__ == "__main__":
    main()
