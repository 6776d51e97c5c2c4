"""An optimizer step against the flat hand-written one, with warm caches and with cold ones.

``mpistrat bench`` interleaves the sides, so each step starts with the caches holding the
other sides' arrays. This tool times each side in two ways, per call after a barrier, mean
over ``--calls``. *warm*: one side at a time, many calls in a row. *cold*: the sides in
turn, and before every call 48 MiB of other memory is read. Unsharded, it then times the
parts on cold caches: packing, the ``Allreduce`` and the update on each side's own arrays,
and mpistrat's handshake and ``strategy.run`` alone. ``docs/performance.md`` quotes it:

    mpiexec -n 2 python -m benchmarks.step_cold_warm --variables 16 --optimizer sgd
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.optimizers import SGD, Adam

LR, B1, B2, EPS, MOMENTUM = 1e-3, 0.9, 0.999, 1e-7, 0.9


class HandWritten:
    """The flat step a user writes: one buffer per slot, one Allreduce, whole-array passes."""

    def __init__(self, optimizer: str, grads: list[np.ndarray], comm: MPI.Intracomm):
        count = sum(g.size for g in grads)
        self.optimizer, self.grads, self.comm, self.steps = optimizer, grads, comm, 0
        self.w, self.fused = np.ones(count, np.float32), np.empty(count, np.float32)
        self.m, self.v = np.zeros(count, np.float32), np.zeros(count, np.float32)

    def __call__(self) -> None:
        self.concatenate()
        self.allreduce()
        self.update()

    def concatenate(self) -> None:
        np.concatenate(self.grads, out=self.fused)

    def allreduce(self) -> None:
        self.comm.Allreduce(MPI.IN_PLACE, self.fused)

    def update(self) -> None:
        self.steps += 1
        g, w, m, v = self.fused, self.w, self.m, self.v
        if self.optimizer == "sgd":
            m *= MOMENTUM
            g *= LR
            m -= g
            w += m
            return
        t = self.steps
        lr_t = LR * math.sqrt(1 - B2**t) / (1 - B1**t)
        m *= B1
        g *= 1 - B1
        m += g
        np.square(g, out=g)
        g *= (1 - B2) / (1 - B1) ** 2
        v *= B2
        v += g
        np.sqrt(v, out=g)
        g += EPS
        np.divide(m, g, out=g)
        g *= lr_t
        w -= g


def timed(comm: MPI.Intracomm, fn: Callable[[], None], before: Callable[[], object]) -> float:
    before()
    comm.Barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=int, default=1 << 20, help="float32 parameters (default 2^20)")
    parser.add_argument("--variables", type=int, default=16)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--shard", action="store_true", help="mpistrat's optimizer with shard_state=True")
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    strategy, comm = mpistrat.MPIStrategy(), MPI.COMM_WORLD.Dup()
    n = args.params // args.variables
    grads = [np.full(n, 0.01 * (comm.rank + 1), np.float32) for _ in range(args.variables)]
    with strategy.scope():
        ws = [mpistrat.Variable(np.ones(n, np.float32)) for _ in range(args.variables)]
        momentum = SGD(LR, momentum=MOMENTUM, shard_state=args.shard)
        opt = momentum if args.optimizer == "sgd" else Adam(LR, B1, B2, EPS, shard_state=args.shard)
    pairs = list(zip(grads, ws, strict=True))
    sides = {
        "mpistrat": lambda: strategy.run(lambda: opt.apply_gradients(pairs)),
        "hand": (hand := HandWritten(args.optimizer, grads, comm)),
    }
    junk = np.ones(12 << 20, np.float32)
    results: dict[str, dict[str, float]] = {"warm": {}, "cold": dict.fromkeys(sides, 0.0)}
    for _block in range(4):  # blocks of calls, each side in turn
        for name, fn in sides.items():
            for _ in range(10):
                fn()
            total = sum(timed(comm, fn, lambda: None) for _ in range(args.calls // 4))
            results["warm"][name] = results["warm"].get(name, 0.0) + total / (args.calls // 4) / 4
    for i in range(args.calls):
        for name in list(sides)[i % 2 :] + list(sides)[: i % 2]:
            results["cold"][name] += timed(comm, sides[name], junk.sum) / args.calls
    if not args.shard:  # the parts of an unsharded step, on cold caches, each side's own arrays
        state = opt._flat_state()
        assert state is not None
        group, collectives = state.groups[0], strategy.extended.collectives
        slots = group.claim_slots()
        parts = {
            "concatenate": (lambda: np.concatenate(grads, out=group.staging), hand.concatenate),
            "Allreduce": (lambda: collectives.all_reduce_in_place(group.staging), hand.allreduce),
            "update": (
                lambda: opt._update_flat(group.params.array, group.staging, slots, LR, 1),
                hand.update,
            ),
        }
        for name, (ours, theirs) in parts.items():
            mine = sum(timed(comm, ours, junk.sum) for _ in range(args.calls)) / args.calls
            other = sum(timed(comm, theirs, junk.sum) for _ in range(args.calls)) / args.calls
            results[f"cold {name}"] = {"mpistrat": mine, "hand": other}
        alone = {
            "handshake": lambda: collectives.agree("apply_gradients"),
            "strategy.run(no-op)": lambda: strategy.run(lambda: None),
        }
        for name, fn in alone.items():
            results[f"cold {name}"] = {
                "mpistrat": sum(timed(comm, fn, junk.sum) for _ in range(args.calls)) / args.calls
            }
    if comm.rank == 0:
        for how, row in results.items():
            if "hand" not in row:
                print(f"{how}: {row['mpistrat'] * 1e6:.0f} us")
                continue
            ratio = row["mpistrat"] / row["hand"]
            print(
                f"{how}: mpistrat {row['mpistrat'] * 1e6:.0f} us, "
                f"hand-written {row['hand'] * 1e6:.0f} us, {ratio:.2f}x"
            )


if __name__ == "__main__":
    main()
