"""What a background save costs the training steps that run while it is written:

    mpiexec -n 2 python -m benchmarks.checkpoint_async --params 16M --rounds 5

A model of ``--params`` float32 parameters in 16 variables with Adam (sharded with ``--shard``).
Each round times ``--steps`` Adam steps alone, then saves in the background
(``CheckpointOptions(enable_async=True)``) and times the steps that run while this rank's share is
still being written (at least one), then ``sync()``. Reported, medians over the rounds of the
slowest rank: a step alone, a step while the save is written, their ratio; how long the save call
took to return (the copy of the share), how long the background write took, and a synchronous save.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.checkpoint import background
from mpistrat.tools.sizes import parse_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=parse_size, default=16 << 20, help="float32 parameters (default 16M)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps timed alone per round")
    p.add_argument("--shard", action="store_true")
    p.add_argument(
        "--dir", default=None, help="where the files go (default: a new folder in the current one)"
    )
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    strategy = mpistrat.MPIStrategy()
    per = args.params // 16
    with strategy.scope():
        ws = [mpistrat.Variable(np.full(per, 0.5, np.float32), name=f"w{i}") for i in range(16)]
        opt = mpistrat.optimizers.Adam(1e-3, shard_state=args.shard)
    grads = [np.full(per, 1e-3, np.float32) for _ in ws]

    def step() -> None:
        strategy.run(lambda: opt.apply_gradients(zip(grads, ws, strict=True)))

    folder = comm.bcast(tempfile.mkdtemp(dir=args.dir or os.getcwd()) if comm.rank == 0 else None)
    ckpt = mpistrat.Checkpoint(model=ws, opt=opt)
    path = os.path.join(folder, "ckpt")
    step()
    ckpt.write(path)
    rows: dict[str, list[float]] = {
        k: [] for k in ("alone", "during", "returned", "written", "sync", "steps")
    }

    def slowest(seconds: float) -> float:
        return comm.allreduce(seconds, op=MPI.MAX)

    for _ in range(args.rounds):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        rows["alone"].append(slowest((time.perf_counter() - start) / args.steps))
        comm.Barrier()
        began = time.perf_counter()
        ckpt.write(path, mpistrat.CheckpointOptions(enable_async=True))
        rows["returned"].append(slowest(time.perf_counter() - began))
        times = []
        while not times or comm.allreduce(background.writing(), op=MPI.LOR):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        rows["written"].append(slowest(time.perf_counter() - began))
        rows["during"].append(slowest(sum(times) / len(times)))
        rows["steps"].append(len(times))
        ckpt.sync()
        comm.Barrier()
        began = time.perf_counter()
        ckpt.write(path)
        rows["sync"].append(slowest(time.perf_counter() - began))
    if comm.rank == 0:
        med = {k: statistics.median(v) for k, v in rows.items()}
        size = os.path.getsize(path)
        print(
            f"{comm.size} ranks, {args.params} parameters with Adam{' (sharded)' if args.shard else ''}, "
            f"file {size / 2**20:.0f} MiB, medians of {args.rounds} rounds (slowest rank)"
        )
        print(f"step alone               {med['alone'] * 1e3:8.1f} ms")
        print(f"step while writing       {med['during'] * 1e3:8.1f} ms  ({med['steps']:.0f} steps)")
        print(f"ratio                    {med['during'] / med['alone']:8.2f}")
        print(
            f"background save returned {med['returned'] * 1e3:8.1f} ms, "
            f"written after {med['written'] * 1e3:.0f} ms"
        )
        print(f"synchronous save         {med['sync'] * 1e3:8.1f} ms")
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)


if __name__ == "__main__":
    main()
