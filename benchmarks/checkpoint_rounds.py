"""What ``benchmarks.save_parts`` and ``benchmarks.restore_parts`` share: their arguments, the model
they save (``--params`` float32 parameters in 16 variables with Adam, sharded with ``--shard``), and
the interleaved rounds that time each side beside raw MPI-IO.

    args = arguments(__doc__)
    model = adam_checkpoint(args)
    times, cpu = interleaved(model.comm, {"raw": raw, "Checkpoint.read": read}, args.rounds)
    report(model, args, times, cpu)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.tools.sizes import parse_size


def arguments(doc: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--params", type=parse_size, default=16 << 20, help="float32 parameters (default 16M)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--shard", action="store_true")
    p.add_argument(
        "--dir", default=None, help="where the files go (default: a new folder in the current one)"
    )
    return p.parse_args()


@dataclasses.dataclass
class Model:
    """The model saved once to ``path``, in a new ``folder`` every rank names alike."""

    comm: MPI.Intracomm
    strategy: mpistrat.MPIStrategy
    checkpoint: mpistrat.Checkpoint
    folder: str
    path: str


def adam_checkpoint(args: argparse.Namespace) -> Model:
    comm = MPI.COMM_WORLD
    strategy = mpistrat.MPIStrategy()
    per_variable = args.params // 16
    with strategy.scope():
        ws = [mpistrat.Variable(np.full(per_variable, 0.5, np.float32), name=f"w{i}") for i in range(16)]
        opt = mpistrat.optimizers.Adam(1e-3, shard_state=args.shard)
        opt.build(ws)
    folder = comm.bcast(tempfile.mkdtemp(dir=args.dir or os.getcwd()) if comm.Get_rank() == 0 else None)
    checkpoint = mpistrat.Checkpoint(model=ws, opt=opt)
    path = checkpoint.write(os.path.join(folder, "ckpt"))
    return Model(comm, strategy, checkpoint, folder, path)


def interleaved(
    comm: MPI.Intracomm,
    sides: dict[str, Callable[[], object]],
    rounds: int,
    after: Callable[[str], None] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each side once per round, in an order that turns each round (the first round warms up):
    the slowest rank's seconds per side, and this rank's CPU seconds (user + system, every thread);
    ``after(name)`` after each timed side."""
    times: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(rounds + 1):
        names = list(sides)
        for name in names[i % len(names) :] + names[: i % len(names)]:
            comm.Barrier()
            used, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            sides[name]()
            elapsed, done = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
            if i:
                times[name].append(comm.allreduce(elapsed, op=MPI.MAX))
                cpu[name].append(done.ru_utime - used.ru_utime + done.ru_stime - used.ru_stime)
                if after is not None:
                    after(name)
    comm.Barrier()
    return times, cpu


def report(
    model: Model, args: argparse.Namespace, times: dict[str, list[float]], cpu: dict[str, list[float]]
) -> None:
    """Rank 0 prints each row's median ms, its ratio to ``raw``'s and its CPU ms, then removes the folder."""
    comm = model.comm
    if comm.Get_rank() == 0:
        base = statistics.median(times["raw"])
        shard = ", sharded" if args.shard else ""
        mib = os.path.getsize(model.path) / 2**20
        print(f"{comm.Get_size()} ranks{shard}, {mib:.0f} MiB, load {os.getloadavg()[0]:.1f}")
        print(f"{'':>18} {'ms':>8} {'x raw':>6} {'CPU ms':>7}")
        for name, seconds in times.items():
            t = statistics.median(seconds)
            used = f"{statistics.median(cpu[name]) * 1e3:7.1f}" if name in cpu else ""
            print(f"{name:>18} {t * 1e3:8.1f} {t / base:6.2f} {used}")
        for name in os.listdir(model.folder):
            os.remove(os.path.join(model.folder, name))
        os.rmdir(model.folder)
