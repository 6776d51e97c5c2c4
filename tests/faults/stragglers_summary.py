"""30 all_reduce steps, rank ``argv[1]`` (-1: none) 50 ms late at each (more than a loaded machine
usually deschedules another rank); the job ends normally.

Every rank first sleeps 10 ms a step, as a step's computation would: with none late, the ranks
then arrive in an order that varies, instead of one rank being last at every step because the
oversubscribed machine keeps descheduling it while the others poll."""

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
        time.sleep(0.01 + (0.05 if rank == late else 0.0))
        strategy.run(ctx_sum)
strategy.run(ctx_sum)
print(f"rank {rank} finished", flush=True)
