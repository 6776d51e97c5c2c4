"""What the consistency check costs a latency-bound step, per setting, beside raw mpi4py.

    mpiexec -n 2 python -m benchmarks.check_cost [--calls 8] [--steps 2000] [--repeats 7]

One step is ``strategy.run`` of a function making ``--calls`` one-element float32
``all_reduce`` calls. The strategies differ only in ``CommunicationOptions(check=...)``: off
(``False``), ``"step"`` and on (``True``); "raw" is the same number of mpi4py ``Allreduce``
calls. Rank 0 prints the best mean over ``--repeats`` loops of ``--steps`` steps, the settings
interleaved, in microseconds per step and as a ratio to the check-off step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat import CommunicationOptions


def per_step(comm: MPI.Intracomm, step: Callable[[], object], steps: int) -> float:
    comm.Barrier()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - began) / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=8, help="all_reduce calls per step (default 8)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    x = np.ones(1, np.float32)
    raw_comm = comm.Dup()
    out = np.empty_like(x)

    def raw() -> None:
        for _ in range(args.calls):
            raw_comm.Allreduce(x, out, op=MPI.SUM)

    def calls() -> list[np.ndarray]:
        ctx = mpistrat.get_replica_context()
        return [ctx.all_reduce("sum", x) for _ in range(args.calls)]

    settings: dict[str, Callable[[], object]] = {"raw": raw}
    for name, check in (("off", False), ("step", "step"), ("on", True)):
        strategy = mpistrat.MPIStrategy(communication_options=CommunicationOptions(check=check))
        settings[name] = lambda strategy=strategy: strategy.run(calls)
    for step in settings.values():  # warm: the first occurrence, caches, buffers
        per_step(comm, step, 50)
    best = dict.fromkeys(settings, float("inf"))
    for _ in range(args.repeats):
        for name, step in settings.items():
            best[name] = min(best[name], per_step(comm, step, args.steps))
    if comm.Get_rank() == 0:
        library = MPI.Get_library_version().splitlines()[0]
        print(f"{comm.Get_size()} ranks, {args.calls} one-element all_reduces per step, {library}")
        for name, seconds in best.items():
            print(f"{name:>5}: {seconds * 1e6:8.1f} us per step  {seconds / best['off']:5.2f}x check off")


if __name__ == "__main__":
    main()
