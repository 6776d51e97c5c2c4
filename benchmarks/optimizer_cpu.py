"""CPU time of the optimizer steps ``mpistrat bench`` times, beside its hand-written ones, in one process.

The bench's cases (``mpistrat.tools.bench_optimizer``) at one rank, each side's step timed with
``time.thread_time`` (the CPU time of this thread: on a machine other jobs share, the time a step
waits for a core does not count), the sides interleaved. Two measures per optimizer: the Python
around the arithmetic (variables of 256 elements, the best of 300 steps, in µs) and a step of
``--size`` bytes (the median over ``--iters`` steps, and mpistrat's over raw2's). ``docs/performance.md``
quotes it:

    python -m benchmarks.optimizer_cpu --ops adam,adamw,rmsprop,lamb,adamw_clip,rmsprop_clip,lamb_clip \
        --leaves 16 256
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.tools.bench_case import Setup
from mpistrat.tools.bench_optimizer import apply_gradients
from mpistrat.tools.sizes import parse_size


def cpu_times(
    strategy: mpistrat.MPIStrategy, op: str, nbytes: int, leaves: int, iters: int
) -> dict[str, list[float]]:
    """Each side's CPU seconds per step, ``iters`` steps each, the sides taking turns; results checked."""
    setup = Setup(strategy, MPI.COMM_WORLD.Dup(), np.dtype(np.float32), nbytes, leaves, 1, "none")
    case = apply_gradients(op)(setup)
    times: dict[str, list[float]] = {side: [] for side in case.variants}
    for _ in range(iters):
        for side, (step, _) in case.variants.items():
            start = time.thread_time()
            step()
            times[side].append(time.thread_time() - start)
    for side, (step, check) in case.variants.items():
        if not check(step()):
            raise SystemExit(f"{op}: {side}'s weights are wrong")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="adam,adamw,rmsprop,lamb,adamw_clip,rmsprop_clip,lamb_clip")
    parser.add_argument("--leaves", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--size", default="4MiB", help="bytes of parameters in the timed step")
    parser.add_argument("--iters", type=int, default=120)
    args = parser.parse_args()
    strategy = mpistrat.MPIStrategy()
    print("op, variables: Python µs (mpistrat, raw2) | step ms (mpistrat, raw, raw2), mpistrat / raw2")
    for leaves in args.leaves:
        for op in args.ops.split(","):
            small = cpu_times(strategy, op, leaves * 256 * 4, leaves, 300)
            large = cpu_times(strategy, op, parse_size(args.size), leaves, args.iters)
            best = {side: min(t) * 1e6 for side, t in small.items()}
            median = {side: float(np.median(t)) * 1e3 for side, t in large.items()}
            print(
                f"{op:14s} {leaves:4d}: {best['mpistrat']:6.0f} {best['raw2']:5.0f} | "
                f"{median['mpistrat']:.2f} {median['raw']:.2f} {median['raw2']:.2f}, "
                f"{median['mpistrat'] / median['raw2']:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
