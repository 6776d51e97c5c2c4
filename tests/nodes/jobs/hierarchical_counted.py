"""HIERARCHICAL all-reduces at several nodes, counted: one JSON line per rank.

For float32 and float64, plain and with bf16 and fp16 compression, each rank records the calls
it made on the node's and the leaders' communicators (tests/support/counting.py) and the worst
error of its result against the exact sum (``math.fsum`` of every rank's input, each rebuilt
here from its seed) relative to docs/concepts.md's bound, and to float rounding alone.
"""

import json
import math

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.collectives import compressed
from mpistrat.comm.hierarchy import LEADERS, NODE
from tests.support.counting import CountingComm, Ledger, ring_bytes

N = 4099  # not a multiple of any node count: the compressed blocks are uneven
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
hosts = world.allgather(MPI.Get_processor_name())
nodes = sorted(set(hosts))
strategy = mpistrat.MPIStrategy(
    CountingComm(world), communication_options=mpistrat.CommunicationOptions(implementation="HIERARCHICAL")
)


def contribution(r: int, dtype: str) -> np.ndarray:
    return (np.random.default_rng(r).standard_normal(N) * 10).astype(dtype)


def bound(dtype: str, codec: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The exact sum, docs/concepts.md's bound for HIERARCHICAL (N nodes, at most L ranks per node,
    node sums P_k) and float rounding alone (what an uncompressed sum may be off by)."""
    parts = [contribution(r, dtype).astype(np.float64) for r in range(size)]
    exact = np.array([math.fsum(float(p[j]) for p in parts) for j in range(N)])
    magnitude = np.sum(np.abs(parts), axis=0)
    eps = 2.0**-24 if dtype == "float32" else 2.0**-53
    most = max(hosts.count(h) for h in nodes)
    rounding = size * eps * magnitude
    if not codec:
        return exact, rounding, rounding
    node_sums = [np.sum([parts[r] for r in range(size) if hosts[r] == h], axis=0) for h in nodes]
    u = compressed.unit_roundoff(codec)
    eta = 2.0**-134 if codec == "bf16" else 2.0**-25
    within = most * eps * magnitude
    k = len(nodes)
    between = (2 * u + (k + 1) * 2.0**-24) * (1 + u) * (np.sum(np.abs(node_sums), axis=0) + within)
    return exact, between + within + (k + 1) * eta, rounding


report = {"rank": rank, "host": hosts[rank], "nodes": len(nodes), "cases": {}}
for dtype in ("float32", "float64"):
    for codec in ("", "bf16", "fp16"):
        options = mpistrat.CommunicationOptions(compression=codec or None)
        x = contribution(rank, dtype)
        step = lambda: mpistrat.get_replica_context().all_reduce("sum", x, options)  # noqa: B023, E731
        strategy.run(step)  # the first one makes the node and leader communicators
        with Ledger.recording() as ledger:
            got = strategy.run(step)
        exact, limit, rounding = bound(dtype, codec)
        err = np.abs(got.astype(np.float64) - exact)
        leaders = ledger.on(LEADERS).log
        report["cases"][f"{dtype} {codec or 'plain'}"] = {
            "leaders": [c.name for c in leaders],
            "leaders_ring_bytes": sum(ring_bytes(c, len(nodes)) for c in leaders),
            "node": [c.name for c in ledger.on(NODE).log],
            "dtype": str(got.dtype),
            "of_bound": float(np.max(err / limit)),
            "of_rounding": float(np.max(err / rounding)),
        }
print(json.dumps(report) + "\n", end="", flush=True)
