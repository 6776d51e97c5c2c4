"""Rank 1 skips an all_reduce and goes on computing; the others time out after 5 s."""

import time

import numpy as np

import mpistrat

strategy = mpistrat.MPIStrategy(communication_options=mpistrat.CommunicationOptions(timeout_seconds=5))
rank = strategy.extended.rank
strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(2)))  # everyone
if rank != 1:
    strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(2)))
time.sleep(60)  # rank 1 is busy elsewhere
