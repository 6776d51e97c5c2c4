"""Under MPISTRAT_CHECK=step, rank 1 stalls after a step's unchecked all_reduce: the others wait in
that step's closing handshake, the one collective of the step that sends a check."""

import time

import numpy as np

import mpistrat

strategy = mpistrat.MPIStrategy()


def step(stall):
    total = mpistrat.get_replica_context().all_reduce("sum", np.ones(2))
    if stall and strategy.extended.rank == 1:
        time.sleep(60)
    return total


for i in range(4):
    strategy.run(step, args=(i == 3,))
