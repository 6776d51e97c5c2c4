"""``mpistrat info --health``: a preflight that times every node and names the slow ones.

    srun --mpi=pmi2 mpistrat info --health        # in the allocation, before the job
    mpiexec -n 8 mpistrat info --health --json

Collective over ``COMM_WORLD``. Each rank measures a fresh interpreter's ``import mpistrat``
and, for a fixed time, float64 matrix products and memory copies; the leaders of neighbouring
nodes (one rank per node) time a 4 B and a 4 MiB message between them. Rank 0 prints a row per
node (``tools/health_report.py``), flags a node beyond 3x the median node, and prints a Slurm
``--exclude=`` line; the command then exits 1 (0 when no node is flagged). The job's start-up
(launch to the first line, ``MPI_Init`` included) and the creation of an ``MPIStrategy`` are
one number each: every rank waits for the last in both, so they name no node. The probes start
together and nothing spins in MPI while they run. It takes a few seconds; each rank's record
goes to rank 0 in one gather (O(R) bytes there).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from mpistrat.comm.hierarchy import Hierarchy
from mpistrat.diagnostics import launch
from mpistrat.diagnostics.startup import process_age
from mpistrat.tools import health_report

__all__ = ["collect", "main"]

_IMPORT = "import time; t = time.perf_counter(); import mpistrat; print(time.perf_counter() - t)"
IMPORT_LIMIT = 120.0  # seconds before the import probe counts as hung
COMPUTE_SECONDS, MEMORY_SECONDS = 0.5, 0.3  # long enough to span a few CPU-quota periods


def _import_seconds() -> float | None:
    """A fresh interpreter's ``import mpistrat``, MPI not started (None: it failed or hung)."""
    env = launch.outside_launch()  # a child interpreter must not take itself for a rank
    env["MPI4PY_RC_INITIALIZE"] = "0"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _IMPORT], env=env, capture_output=True, text=True, timeout=IMPORT_LIMIT
        )
        return float(done.stdout.split()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _rate(seconds: float, work: Any) -> float:
    """Units of ``work()`` per second, running it for about ``seconds``."""
    done, start = 0.0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        done += work()
    return done / elapsed


def _probes() -> tuple[float, float]:
    """(GFLOP/s of float64 multiply-adds on an in-cache array, GB/s of copying 32 MiB arrays) on this
    rank. Plain ufuncs, one thread: a BLAS call would start threads that fight the other ranks'."""
    x = np.random.default_rng(0).random(4096)

    def arithmetic() -> float:
        np.multiply(x, 0.999999, out=x)
        np.add(x, 1e-6, out=x)
        return 2 * x.size / 1e9

    src, dst = np.ones(1 << 22), np.ones(1 << 22)  # both touched: no page faults in the timing

    def copy() -> float:
        np.copyto(dst, src)
        return 2 * src.nbytes / 1e9  # read and written

    return _rate(COMPUTE_SECONDS, arithmetic), _rate(MEMORY_SECONDS, copy)


def _wait(comm: MPI.Intracomm) -> None:
    """A barrier that does not spin: ranks that finished a probe leave the CPU to those still in it
    (MPI libraries spin in blocking calls, and a slow node's ranks would be slower still)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.001)


def _ping_pong(comm: MPI.Intracomm, partner: int, first: bool, nbytes: int, reps: int) -> float:
    """One-way seconds of ``nbytes`` to ``partner`` and back, ``reps`` times (after one warm-up)."""
    buf = np.zeros(max(nbytes, 1), dtype=np.uint8)
    elapsed = 0.0
    for i in range(reps + 1):
        start = time.perf_counter()
        if first:
            comm.Send(buf, dest=partner, tag=7)
            comm.Recv(buf, source=partner, tag=7)
        else:
            comm.Recv(buf, source=partner, tag=7)
            comm.Send(buf, dest=partner, tag=7)
        if i:
            elapsed += time.perf_counter() - start
    return elapsed / (2 * reps)


def _partner(me: int, n: int, round_: int) -> tuple[int, bool] | None:
    """This leader's partner in a round of pairs, and whether it sends first; None: it sits out.

    Round 0 pairs (0, 1), (2, 3), ...; round 1 pairs (1, 2), (3, 4), ... and, for an even count
    above 2, (N-1, 0): every node meets both neighbours on a ring, O(N) messages in all.

    >>> [_partner(me, 4, 1) for me in range(4)]
    [(3, False), (2, True), (1, False), (0, True)]
    """
    ring = round_ == 1 and n % 2 == 0 and n > 2
    if (me - round_) % 2 == 0:
        return (me + 1, True) if me + 1 < n else ((0, True) if ring else None)
    return (me - 1, False) if me >= 1 else ((n - 1, False) if ring else None)


def _links(leaders: MPI.Intracomm, hosts: list[str]) -> dict[str, tuple[float, float]]:
    """The other node -> (4 B, 4 MiB) one-way seconds, for each neighbour this leader sends to first.

    Pairs of a round run at once, each on its own link.
    """
    found: dict[str, tuple[float, float]] = {}
    for round_ in (0, 1):
        pair = _partner(leaders.Get_rank(), leaders.Get_size(), round_)
        if pair is not None:
            partner, first = pair
            small = _ping_pong(leaders, partner, first, 4, 50)
            large = _ping_pong(leaders, partner, first, 4 << 20, 4)
            if first:
                found[hosts[partner]] = (small, large)
        _wait(leaders)
    return found


def measure(comm: MPI.Intracomm, startup: float | None = None) -> dict[str, Any]:
    """This rank's record (collective over ``comm``); ``startup``: its age before the first collective."""
    import mpistrat  # the library the check is about; the tools' import of it is cheap by now

    record: dict[str, Any] = {"rank": comm.Get_rank(), "host": MPI.Get_processor_name(), "startup": startup}
    _wait(comm)
    record["imported"] = _import_seconds()
    _wait(comm)
    start = time.perf_counter()
    strategy = mpistrat.MPIStrategy(comm)
    record["strategy"] = time.perf_counter() - start
    strategy.experimental_finalize()
    _wait(comm)
    record["gflops"], record["gbps"] = _probes()
    _wait(comm)
    hierarchy = Hierarchy(comm)
    record["links"] = {}
    try:
        if hierarchy.leaders is not None and hierarchy.leaders.Get_size() > 1:
            hosts = hierarchy.leaders.allgather(record["host"])
            record["links"] = _links(hierarchy.leaders, hosts)
    finally:
        hierarchy.free()
    _wait(comm)
    return record


def collect(comm: MPI.Intracomm | None = None) -> dict[str, Any] | None:
    """Every rank's record, each node's row and the flagged nodes, on rank 0 (None elsewhere)."""
    startup = process_age()
    comm = comm or MPI.COMM_WORLD
    _wait(comm)  # ranks start unevenly: the early ones wait here without spinning in Dup
    comm = comm.Dup()
    try:
        ranks = comm.gather(measure(comm, startup), root=0)
    finally:
        comm.Free()
    if ranks is None:
        return None
    nodes = health_report.per_node(ranks)
    found = health_report.flagged(nodes)
    return {
        "job": health_report.job(ranks),
        "nodes": {host: {k: _finite(v) for k, v in row.items()} for host, row in nodes.items()},
        "flagged": found,
        "exclude": health_report.exclude_line(found) if found else None,
        "ranks": ranks,
    }


def _finite(value: float | None) -> float | None:
    """JSON has no infinity: a probe that failed or hung is null."""
    return None if value is None or math.isinf(value) else value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpistrat info --health", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args([a for a in (sys.argv[1:] if argv is None else argv) if a != "--health"])
    report = collect()
    # Every rank exits with the verdict: launchers differ in what they make of ranks that disagree.
    slow = MPI.COMM_WORLD.bcast(bool(report and report["flagged"]), root=0)
    if report is None:
        return 1 if slow else 0
    if args.json:
        print(json.dumps(report, indent=2), flush=True)
    else:
        text = health_report.render(report["nodes"], report["flagged"], len(report["ranks"]), report["job"])
        print(text, flush=True)
    if report["flagged"]:
        print(f"mpistrat info --health: slow node(s); {report['exclude']}", file=sys.stderr, flush=True)
        return 1
    return 0
