"""Rank 1 skips an all_reduce; the others time out after 2 s, catch the error, call again and
finalize the strategy.

A timed-out handshake may still be in flight, so the next one on that strategy must raise at
once, saying so, rather than start it again (erroneous in MPI: a hang or worse), and finalizing
must not free it (freeing an active request is erroneous too: Open MPI raises). The watchdog
then ends the job.
"""

import time

import numpy as np

import mpistrat

strategy = mpistrat.MPIStrategy(communication_options=mpistrat.CommunicationOptions(timeout_seconds=2))
rank = strategy.extended.rank


def total():
    return strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(2)))


total()  # everyone
if rank != 1:
    try:
        total()
    except mpistrat.CollectiveTimeoutError:
        print(f"rank {rank} timed out", flush=True)
    try:
        total()
    except mpistrat.CollectiveTimeoutError as exc:
        print(f"rank {rank} again: {exc}", flush=True)
    strategy.experimental_finalize()
    print(f"rank {rank} finalized", flush=True)
time.sleep(60)  # rank 1 is busy elsewhere; the watchdog ends the job
