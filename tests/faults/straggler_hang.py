"""Rank 1 is 20 ms late at 20 all_reduce steps, then hangs (in Python) past the others' 4 s timeout.

The stall warning names rank 1 as the straggler before it; the stall warning and the timeout
print every rank's flight record.
"""

import time

import numpy as np

import mpistrat

strategy = mpistrat.MPIStrategy(communication_options=mpistrat.CommunicationOptions(timeout_seconds=4))
rank = strategy.extended.collectives.rank
ctx_sum = lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(4))  # noqa: E731
for _ in range(20):
    if rank == 1:
        time.sleep(0.02)
    strategy.run(ctx_sum)
if rank == 1:
    time.sleep(30)  # hung: the others time out in their next all_reduce
strategy.run(ctx_sum)
