"""Under MPISTRAT_CHECK=step, rank 1 stalls after a step's unchecked all_reduce: the others wait in
that step's closing handshake, the one collective of the step that sends a check. It stalls for 60 s,
or for the seconds given, and then the job goes on to its end."""

import sys
import time

import numpy as np

import mpistrat

strategy = mpistrat.MPIStrategy()
stall = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0


def step(stalls):
    total = mpistrat.get_replica_context().all_reduce("sum", np.ones(2))
    if stalls and strategy.extended.rank == 1:
        time.sleep(stall)
    return total


for i in range(4):
    strategy.run(step, args=(i == 3,))
closing = strategy.extended.collectives.native_closing  # the compiled closing, where it runs
compiled = closing.closes if closing else 0
print(f"rank {strategy.extended.rank} finished, its closings {compiled} compiled", flush=True)
