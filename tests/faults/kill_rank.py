"""Rank 1 is killed with SIGKILL while the others are inside all_reduce (timeout 5 s; with
``--default``, default settings)."""

import os
import signal
import sys
import time

import numpy as np

import mpistrat

options = None if "--default" in sys.argv else mpistrat.CommunicationOptions(timeout_seconds=5)
strategy = mpistrat.MPIStrategy(communication_options=options)
ctx_sum = lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(4))  # noqa: E731
strategy.run(ctx_sum)
if strategy.extended.rank == 1:
    time.sleep(1.0)  # let the others enter the all_reduce first
    os.kill(os.getpid(), signal.SIGKILL)
strategy.run(ctx_sum)
