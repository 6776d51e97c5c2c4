"""Peak memory of one all_gather of 200 MiB of float64 per rank: the numbers in docs/performance.md.

    mpiexec -n 2 python -m benchmarks.all_gather_memory {leaf,nest,axis1}

Prints, on rank 0, how much the peak resident set grew around the call (the input is
allocated before; the output is R times the input).
"""

import resource
import sys

import numpy as np
from mpi4py import MPI

from mpistrat.collectives import Collectives

case = sys.argv[1] if len(sys.argv) > 1 else "leaf"
collectives = Collectives(MPI.COMM_WORLD.Dup())
n = 200 << 20
if case == "leaf":
    value, axis = [np.ones(n // 8)], 0
elif case == "nest":
    value, axis = [np.ones(n // 32) for _ in range(4)], 0
else:
    value, axis = [np.ones((1024, n // 8 // 1024))], 1
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = collectives.all_gather(value, axis=axis)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
if MPI.COMM_WORLD.Get_rank() == 0:
    total = sum(o.nbytes for o in out) >> 20
    print(f"{case}: input {n >> 20} MiB, output {total} MiB, peak growth {grown >> 10} MiB")
