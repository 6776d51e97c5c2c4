"""Every rank enters one large all_gather at once; it outlasts MPISTRAT_STALL_WARNING_SECONDS.

argv[1]: MiB each rank contributes (default 100). No rank is missing: a warning must say so.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import mpistrat

mib = float(sys.argv[1]) if len(sys.argv) > 1 else 100.0
rank = MPI.COMM_WORLD.Get_rank()
# Filled before the strategy: a rank still filling 300 MiB when another reaches the opening
# all_reduce would rightly be named as missing from it (seen on a loaded machine).
local = np.full(int(mib * 2**20) // 8, float(rank))
strategy = mpistrat.MPIStrategy()
size = strategy.extended.size
strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1.0))  # everyone has started
began = time.monotonic()
gathered = strategy.run(lambda: mpistrat.get_replica_context().all_gather(local, axis=0))
took = time.monotonic() - began
assert gathered.shape == (size * local.size,) and gathered[-1] == size - 1, gathered.shape
del gathered
print(f"rank {rank} gathered {size * mib:g} MiB in {took:.2f} s", flush=True)
time.sleep(0.5)  # let any late warning come out before the job ends
print(f"rank {rank} finished", flush=True)
