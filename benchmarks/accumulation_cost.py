"""Time of one gradient accumulation cycle: plain against deterministic, beside raw mpi4py.

    mpiexec -n 2 python -m benchmarks.accumulation_cost [--sizes 64K 1M 16M] [--steps 4] [--repeat 10]

One cycle is ``--steps`` (K) calls of ``Adam(..., gradient_accumulation_steps=K).apply_gradients``
on one float32 variable of ``size`` bytes: K-1 quiet calls (kept locally, no communication) and
the K-th (one reduction, the update). "raw" is the loop a user would write with mpi4py: add the
gradient into a NumPy sum K-1 times, then one ``Allreduce`` and the same Adam update in NumPy.
Deterministic keeps the K gradients and sums them exactly (integer limbs) in the K-th call.
Times are medians over ``--repeat`` cycles, interleaved across the modes, on rank 0's clock.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.optimizers import Adam
from mpistrat.options import CommunicationOptions
from mpistrat.tools.sizes import parse_size


def raw_cycle(
    comm: MPI.Intracomm, w: np.ndarray, m: np.ndarray, v: np.ndarray, grads: list[np.ndarray], t: int
) -> None:
    """The hand-written cycle: accumulate, one Allreduce, Adam in place."""
    total = grads[0].copy()
    for g in grads[1:-1]:
        total += g
    total += grads[-1]
    total /= len(grads)
    comm.Allreduce(MPI.IN_PLACE, total)
    lr_t = 1e-3 * math.sqrt(1 - 0.999**t) / (1 - 0.9**t)
    m *= 0.9
    total *= 0.1
    m += total
    np.square(total, out=total)
    total *= 0.001 / 0.01
    v *= 0.999
    v += total
    np.sqrt(v, out=total)
    total += 1e-7
    np.divide(m, total, out=total)
    total *= lr_t
    w -= total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[64 << 10, 1 << 20, 16 << 20])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    strategy = mpistrat.MPIStrategy(comm)
    k = args.steps
    if comm.Get_rank() == 0:
        print(f"ranks {comm.Get_size()}, float32, K = {k}, {MPI.Get_library_version().splitlines()[0]}")
        print(f"{'bytes':>9} {'mode':>13} {'quiet us':>9} {'K-th us':>10} {'cycle us':>10} {'x raw':>6}")
    for nbytes in args.sizes:
        n = nbytes // 4
        rng = np.random.default_rng(comm.Get_rank())
        grads = [rng.standard_normal(n).astype(np.float32) for _ in range(k)]
        setups = {}
        for name, opts in (("plain", None), ("deterministic", CommunicationOptions(deterministic=True))):
            with strategy.scope():
                w = mpistrat.Variable(np.zeros(n, np.float32))
                opt = Adam(communication_options=opts, gradient_accumulation_steps=k)
            setups[name] = (w, opt)
        raw = (np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32))
        quiet: dict[str, list[float]] = {name: [] for name in [*setups, "raw"]}
        last: dict[str, list[float]] = {name: [] for name in quiet}
        for cycle in range(args.repeat + 1):  # the first cycle builds the slots: not timed
            for name, (w, opt) in setups.items():
                comm.Barrier()
                start = time.perf_counter()
                for g in grads[:-1]:
                    strategy.run(lambda g=g, w=w, opt=opt: opt.apply_gradients([(g, w)]))
                middle = time.perf_counter()
                strategy.run(lambda g=grads[-1], w=w, opt=opt: opt.apply_gradients([(g, w)]))
                end = time.perf_counter()
                if cycle:
                    quiet[name].append((middle - start) / max(k - 1, 1))
                    last[name].append(end - middle)
            comm.Barrier()
            start = time.perf_counter()
            raw_cycle(comm, *raw, grads, cycle + 1)
            if cycle:
                last["raw"].append(time.perf_counter() - start)
                quiet["raw"].append(0.0)
        if comm.Get_rank() == 0:
            raw_time = statistics.median(last["raw"])
            for name in quiet:
                q, t = statistics.median(quiet[name]), statistics.median(last[name])
                cycle_time = t + (k - 1) * q
                shown = "-" if name == "raw" else f"{q * 1e6:.1f}"
                print(
                    f"{nbytes:>9} {name:>13} {shown:>9} {t * 1e6:>10.1f} {cycle_time * 1e6:>10.1f} "
                    f"{cycle_time / raw_time:>6.2f}"
                )


if __name__ == "__main__":
    main()
