"""What the consistency check costs: all_reduce of a small array, check on vs off, vs raw mpi4py.

    mpiexec -n 2 python -m mpistrat.tools.bench_check [--size 8] [--iters 2000] [--repeats 15]

Prints microseconds per call (median and best of the repeats) on rank 0 for:
raw ``comm.Allreduce``, ``Iallreduce`` and a persistent ``Allreduce_init`` started and waited
(what the handshake is, where MPI has it); ``ReplicaContext.all_reduce`` with the check
off; with the check on (the default); with the check on and a timeout (the handshake is
then polled). Then per step: ``strategy.run`` of ``--step-calls`` such
``all_reduce`` calls on strategies whose check is off, ``"step"`` (one handshake per run)
and on, beside the same number of raw ``Allreduce`` calls.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.tools.replica import replica_context


def timed(comm: MPI.Intracomm, call, iters: int, repeats: int) -> tuple[float, float]:
    for _ in range(max(iters // 10, 10)):  # warm up
        call()
    per_call = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)  # the slowest rank
        per_call.append(elapsed / iters * 1e6)
    return statistics.median(per_call), min(per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8, help="float64 elements per all_reduce")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--step-calls", type=int, default=8, help="all_reduce calls per strategy.run")
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    comm = world.Dup()
    strategy = mpistrat.MPIStrategy(world)
    x = np.ones(args.size)
    out = np.empty_like(x)
    persistent = _persistent(comm, x, out)
    variants: dict[str, Callable[[], Any] | mpistrat.CommunicationOptions] = {
        "raw comm.Allreduce": lambda: comm.Allreduce(x, out, op=MPI.SUM),
        "raw comm.Iallreduce + Wait": lambda: comm.Iallreduce(x, out, op=MPI.SUM).Wait(),
        **(
            {"raw persistent Start + Wait": functools.partial(_start_wait, persistent)}
            if persistent is not None
            else {}
        ),
        "all_reduce, check off": mpistrat.CommunicationOptions(check=False),
        "all_reduce, check on (default)": mpistrat.CommunicationOptions(check=True),
        "all_reduce, check on + timeout": mpistrat.CommunicationOptions(check=True, timeout_seconds=600),
    }
    results = {}
    for name, variant in variants.items():
        if callable(variant):
            results[name] = timed(comm, variant, args.iters, args.repeats)
            continue

        def loop(options: mpistrat.CommunicationOptions = variant) -> tuple[float, float]:
            ctx = replica_context()
            return timed(comm, lambda: ctx.all_reduce("sum", x, options), args.iters, args.repeats)

        results[name] = strategy.run(loop)
    if persistent is not None:
        persistent.Free()
    steps = _steps(comm, x, out, args.step_calls, max(args.iters // args.step_calls, 10), args.repeats)
    if world.Get_rank() == 0:
        print(f"{world.Get_size()} ranks, {args.size} float64, {args.iters} calls x {args.repeats} repeats")
        print(f"{'variant':34s} {'median us':>10s} {'best us':>9s}")
        for name, (median, best) in results.items():
            print(f"{name:34s} {median:10.1f} {best:9.1f}")
        print(f"\nper step of {args.step_calls} all_reduce calls in strategy.run")
        print(f"{'check':34s} {'median us':>10s} {'best us':>9s} {'x off':>6s}")
        for name, (median, best, ratio) in steps.items():
            print(f"{name:34s} {median:10.1f} {best:9.1f} {ratio:6.2f}")
        print("(x off: the median over the repeats of each repeat's time over the check-off time in it)")


def _start_wait(request: MPI.Prequest) -> None:
    request.Start()
    request.Wait()


def _persistent(comm: MPI.Intracomm, x: np.ndarray, out: np.ndarray) -> MPI.Prequest | None:
    try:
        return comm.Allreduce_init(x, out, MPI.SUM)
    except NotImplementedError:  # an MPI before MPI-4
        return None


def _steps(
    comm: MPI.Intracomm, x: np.ndarray, out: np.ndarray, calls: int, iters: int, repeats: int
) -> dict[str, tuple[float, float, float]]:
    """Microseconds per step (median, best) for raw calls and each check setting, interleaved, and
    the median of the repeats' ratios to the check off (paired: a slow moment hits both)."""

    def raw() -> None:
        for _ in range(calls):
            comm.Allreduce(x, out, op=MPI.SUM)

    def step() -> list[Any]:
        ctx = replica_context()
        return [ctx.all_reduce("sum", x) for _ in range(calls)]

    variants: dict[str, Callable[[], Any]] = {"raw Allreduce": raw}
    for name, check in (("off", False), ("step", "step"), ("on", True)):
        strategy = mpistrat.MPIStrategy(
            comm, communication_options=mpistrat.CommunicationOptions(check=check)
        )
        variants[name] = functools.partial(strategy.run, step)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):  # interleaved: a slow moment of a shared machine hits every variant
        for name, call in variants.items():
            samples[name].append(timed(comm, call, iters, 1)[0])
    off = samples["off"]
    return {
        name: (statistics.median(v), min(v), statistics.median(a / b for a, b in zip(v, off, strict=True)))
        for name, v in samples.items()
    }


if __name__ == "__main__":
    main()
