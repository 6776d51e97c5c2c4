"""Rank 2 arrives 3 s late at an all_reduce; with MPISTRAT_STALL_WARNING_SECONDS=1 the others warn."""

import time

import numpy as np

import mpistrat

strategy = mpistrat.MPIStrategy()
ctx_sum = lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(4))  # noqa: E731
strategy.run(ctx_sum)
if strategy.extended.rank == 2:
    time.sleep(3.0)  # slow, not stuck
total = strategy.run(ctx_sum)
assert total.tolist() == [3.0] * 4, total
print(f"rank {strategy.extended.rank} finished", flush=True)
