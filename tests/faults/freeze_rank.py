"""Rank ``argv[1]`` (default 1) freezes (SIGSTOP: alive, unresponsive) while the others are in all_reduce.

A frozen rank 0 is also the watchdog's coordinator, so another rank must stand in for it.
With ``--default-timeout S`` no timeout is chosen: the default, shortened to S seconds, ends the job.
"""

import dataclasses
import os
import signal
import sys
import time

import numpy as np

import mpistrat
from mpistrat import config

frozen = int(sys.argv[1]) if len(sys.argv) > 1 else 1
if "--default-timeout" in sys.argv:
    setting = config.SETTINGS["MPISTRAT_TIMEOUT"]
    seconds = float(sys.argv[sys.argv.index("--default-timeout") + 1])
    config.SETTINGS["MPISTRAT_TIMEOUT"] = dataclasses.replace(setting, default=seconds)
    strategy = mpistrat.MPIStrategy()
else:
    strategy = mpistrat.MPIStrategy(communication_options=mpistrat.CommunicationOptions(timeout_seconds=5))
ctx_sum = lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(4))  # noqa: E731
strategy.run(ctx_sum)
if strategy.extended.rank == frozen:
    time.sleep(1.0)  # let the others enter the all_reduce first
    os.kill(os.getpid(), signal.SIGSTOP)
strategy.run(ctx_sum)
