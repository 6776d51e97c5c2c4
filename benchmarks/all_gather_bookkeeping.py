"""Python time all_gather spends cutting a multi-leaf pack apart at R ranks, without MPI.

    python -m benchmarks.all_gather_bookkeeping 1024 64

Calls the unpacking step with a stand-in transport, so R can be far more than this
machine runs: what matters is that its work grows as R * L, not R * L^2.
"""

import sys
import time
import types

import numpy as np

from mpistrat.collectives.all_gather import _allgather_pack
from mpistrat.comm import packing

ranks, leaves = int(sys.argv[1]), int(sys.argv[2])
moved = [np.ones((2, 3), np.float32) for _ in range(leaves)]
pack = packing.plan_packs(moved)[0]
sizes = np.full((ranks, leaves), 2, dtype=np.int64)
transport = types.SimpleNamespace(allgatherv=lambda send, recv, counts, displs: None)
stub = types.SimpleNamespace(transports=types.SimpleNamespace(get=lambda *a: transport), size=ranks)
out: list = [None] * leaves
start = time.perf_counter()
_allgather_pack(stub, moved, pack, sizes, out)
print(f"{ranks} ranks, {leaves} leaves: {time.perf_counter() - start:.3f} s")
