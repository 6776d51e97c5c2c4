"""Collectives in a user's atexit handler, registered before the strategy is created.

The first argument says what the handlers do: ``every`` (every rank's handler all-reduces:
it must work and the job end 0), ``early`` (rank 1's handler returns before its
all_reduce: the others must end the job, naming rank 1, and ``mpiexec`` exit non-zero),
``before_import`` (as ``early``, but registered before ``import mpistrat``, so it runs after
mpistrat's exit hook: the others must still end, by the default timeout shortened to 3 s,
naming the all_reduce, and exit non-zero).
"""

import atexit
import dataclasses
import sys

import numpy as np
from mpi4py import MPI

how = sys.argv[1]
rank = MPI.COMM_WORLD.Get_rank()
strategy = None


def last_words():
    if rank == 1 and how != "every":
        print("rank 1 returns early from its exit handler", flush=True)
        return
    total = strategy.reduce("sum", strategy.run(lambda: np.ones(2, np.float32)), axis=None)
    print(f"rank {rank} exit handler total {total.tolist()}", flush=True)


if how == "before_import":
    atexit.register(last_words)

import mpistrat  # noqa: E402

if how != "before_import":
    atexit.register(last_words)
else:
    setting = mpistrat.config.SETTINGS["MPISTRAT_TIMEOUT"]
    mpistrat.config.SETTINGS["MPISTRAT_TIMEOUT"] = dataclasses.replace(setting, default=3.0)

strategy = mpistrat.MPIStrategy()
strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(2, np.float32)))
print(f"rank {rank} finished", flush=True)
