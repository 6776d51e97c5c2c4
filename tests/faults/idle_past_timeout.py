"""A healthy job idles past MPISTRAT_TIMEOUT between collectives; then rank 1 is a little late
to a cross-replica write, a variable creation and a merge_call. None of them may time out."""

import time

import numpy as np
from mpi4py import MPI

import mpistrat

MPI.COMM_WORLD.Barrier()  # every rank has started: the timeout below is for the collectives, not the start
strategy = mpistrat.MPIStrategy()
rank = strategy.extended.rank
with strategy.scope():
    v = mpistrat.Variable(np.zeros(3))
    strategy.reduce("sum", np.ones(2))  # a watched collective: its deadline passes during the idle time
    time.sleep(6.5)  # past that deadline and the watchdog's grace periods
    if rank == 1:
        time.sleep(0.3)
    v.assign(np.ones(3))
    if rank == 1:
        time.sleep(0.3)
    w = mpistrat.Variable(np.ones(2))
total = strategy.run(lambda: mpistrat.get_replica_context().merge_call(lambda s: 1))
assert total == 1 and v.numpy().tolist() == [1.0] * 3 and w.numpy().tolist() == [1.0] * 2
print(f"rank {rank} finished", flush=True)
