"""Milliseconds per optimizer update over flat storage, in whole passes or in cache-sized blocks.

The local part of a step alone (no communication): gradients packed into the staging
buffer and the update's passes over parameters and slots, for each block size, best of
repeats. ``docs/performance.md`` quotes it to choose ``pack_step.BLOCK`` and ``WHOLE``:

    python -m benchmarks.update_blocks --params 1M 16M --optimizer sgd adam
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import mpistrat
from mpistrat.optimizers import SGD, Adam
from mpistrat.tools.sizes import parse_size
from mpistrat.training import pack_step

BLOCKS = [1 << 16, 1 << 18, 1 << 20, 0]  # elements; 0: one pass over everything


def best_ms(
    strategy: mpistrat.MPIStrategy, optimizer: str, count: int, block: int, variables: int, repeats: int
) -> float:
    pack_step.WHOLE = count if block == 0 else 0
    pack_step.BLOCK = block or count
    with strategy.scope():
        ws = [mpistrat.Variable(np.ones(count // variables, np.float32)) for _ in range(variables)]
        opt = Adam(1e-3) if optimizer == "adam" else SGD(1e-3, momentum=0.9)
    grads = [np.full(count // variables, 0.01, np.float32) for _ in range(variables)]
    opt.build(ws)
    state = opt._flat_state()
    assert state is not None
    loops = max(3, (1 << 24) // count)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for k in range(loops):
            state.step(None, grads, ws, opt._update_flat, 1e-3, k)
        best = min(best, (time.perf_counter() - start) / loops)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", nargs="+", default=["1M", "16M"], help="float32 parameters (1M = 2^20)")
    parser.add_argument("--optimizer", nargs="+", default=["sgd", "adam"], choices=["sgd", "adam"])
    parser.add_argument("--variables", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    strategy = mpistrat.MPIStrategy()
    print("optimizer  params  " + "  ".join(f"{b or 'whole':>8}" for b in BLOCKS))
    for optimizer in args.optimizer:
        for text in args.params:
            count = parse_size(text.replace("M", "MiB").replace("K", "KiB"))
            times = [best_ms(strategy, optimizer, count, b, args.variables, args.repeats) for b in BLOCKS]
            print(f"{optimizer:9}  {text:>6}  " + "  ".join(f"{t:8.2f}" for t in times))


if __name__ == "__main__":
    main()
