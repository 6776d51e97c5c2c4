"""Rank ``argv[1]`` is 3 s late at an all_reduce; with MPISTRAT_STALL_WARNING_SECONDS=1 the others warn."""

import sys
import time

import numpy as np

import mpistrat

late = int(sys.argv[1])
strategy = mpistrat.MPIStrategy()
rank, size = strategy.extended.rank, strategy.num_replicas_in_sync
ctx_sum = lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(4))  # noqa: E731
strategy.run(ctx_sum)
if rank == late:
    time.sleep(3.0)  # slow, not stuck
total = strategy.run(ctx_sum)
assert total.tolist() == [float(size)] * 4, total
print(f"rank {rank} finished", flush=True)
