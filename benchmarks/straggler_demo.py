"""The run shown in docs/diagnosing.md: one rank with a bigger input shard holds the others up.

    MPISTRAT_TIMELINE=results/timeline mpiexec -n 4 python -m benchmarks.straggler_demo
    mpistrat timeline results/timeline -o results/trace.json
    mpistrat plot results/timeline -o docs/img/heatmap-stragglers.png

Each rank multiplies its shard of a batch through a two-layer network and all-reduces
the gradients; rank 2's shard is ``--skew`` times the others' for the second half of
the run, as an unbalanced input split would make it.
"""

from __future__ import annotations

import argparse

import numpy as np

import mpistrat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rows", type=int, default=256, help="rows of each rank's shard")
    parser.add_argument("--skew", type=float, default=3.0, help="rank 2's shard, times the others'")
    args = parser.parse_args()

    strategy = mpistrat.MPIStrategy()
    rank = strategy.extended.collectives.rank
    rng = np.random.default_rng(rank)
    w1 = rng.standard_normal((256, 256)).astype(np.float32)
    w2 = rng.standard_normal((256, 10)).astype(np.float32)

    def step(rows: int):
        x = rng.standard_normal((rows, 256)).astype(np.float32)
        with mpistrat.trace("forward and backward"):
            h = np.maximum(x @ w1, 0)
            g2 = h.T @ (h @ w2)
            g1 = x.T @ ((h @ w2) @ w2.T * (h > 0))
        ctx = mpistrat.get_replica_context()
        return ctx.all_reduce("mean", [g1, g2])

    for i in range(args.steps):
        skewed = rank == 2 and i >= args.steps // 2
        with mpistrat.trace("step"):
            strategy.run(step, args=(int(args.rows * (args.skew if skewed else 1)),))
    strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.zeros(1)))
    if rank == 0:
        print(strategy.extended.stragglers())


if __name__ == "__main__":
    main()
