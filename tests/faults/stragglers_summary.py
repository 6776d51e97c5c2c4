"""30 all_reduce steps, rank ``argv[1]`` (-1: none) 20 ms late at each; the job ends normally."""

import sys
import time

import numpy as np

import mpistrat

late = int(sys.argv[1])
strategy = mpistrat.MPIStrategy()
rank = strategy.extended.collectives.rank
ctx_sum = lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(4))  # noqa: E731
for _ in range(30):
    with mpistrat.trace("step"):
        if rank == late:
            time.sleep(0.02)
        strategy.run(ctx_sum)
strategy.run(ctx_sum)
print(f"rank {rank} finished", flush=True)
