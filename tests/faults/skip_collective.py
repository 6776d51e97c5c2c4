"""Rank 1 skips an all_reduce and goes on computing; the others time out after 5 s.

The timeout comes from CommunicationOptions, or with ``--env`` from MPISTRAT_TIMEOUT.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import mpistrat

MPI.COMM_WORLD.Barrier()  # every rank has started: the timeout below is for the collectives, not the start
options = None if "--env" in sys.argv else mpistrat.CommunicationOptions(timeout_seconds=5)
strategy = mpistrat.MPIStrategy(communication_options=options)
rank = strategy.extended.rank
strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(2)))  # everyone
if rank != 1:
    strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(2)))
time.sleep(60)  # rank 1 is busy elsewhere
