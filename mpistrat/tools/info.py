"""``mpistrat info``: what MPI, CUDA and transports this job sees. Run it first on a new cluster.

    mpiexec -n 2 mpistrat info          # or: mpiexec -n 2 python -m mpistrat info
    mpistrat info --json
    mpiexec -n 8 mpistrat info --health # a preflight: which nodes are slow (tools/health.py)

It is collective over ``COMM_WORLD`` (every rank must run it); rank 0 prints the
MPI library, mpi4py, whether MPI is CUDA-aware and how that was decided, CuPy,
CUDA and NCCL versions, ranks per node, what the launcher started beside what MPI
joined (a task MPI started alone makes it exit 1, saying why), each host's logical cores
against its ranks (more ranks than the cores they may use is oversubscribed: they take turns,
and collectives wait for them), the thread settings of OpenMP and the BLAS, whether a rank's
death is survived in this launch (ULFM) and why not, the rank -> host -> CPUs -> device map,
and the transport ``CommunicationImplementation.AUTO`` picks for host and device buffers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import mpi4py
from mpi4py import MPI

from mpistrat.collectives import step_check
from mpistrat.comm import cuda, devices, transport
from mpistrat.diagnostics import launch, ulfm
from mpistrat.errors import MpistratError
from mpistrat.tools import host
from mpistrat.tools.bench_meta import cpu_list
from mpistrat.tools.columns import columns

__all__ = ["collect", "main", "render"]


def _cuda_version(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def _local_report(comm: MPI.Intracomm) -> dict[str, Any]:
    """This rank's view (collective: placement splits ``comm`` by node)."""
    placement = devices.place(comm)
    awareness = cuda.cuda_awareness()
    if devices.requested_mode(os.environ) == "cpu":
        cupy, cupy_text = None, f"not used ({devices.DEVICE_ENV}=cpu)"
    else:
        cupy, why = devices.import_cupy()
        cupy_text = (
            cupy.__version__ if cupy is not None else why.replace("CuPy is not installed", "not installed")
        )
    cpus = host.cpus()
    report: dict[str, Any] = {
        "rank": comm.Get_rank(),
        "host": placement.host,
        "cpus": cpus,
        "logical_cores": os.cpu_count() or 1,
        "local_rank": placement.local_rank,
        "local_size": placement.local_size,
        "device": placement.device(comm.Get_rank()),
        "placement": placement.reason,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_aware": awareness.aware,
        "cuda_aware_how": awareness.how,
        "cupy": cupy_text,
        "cuda_runtime": None,
        "cuda_driver": None,
        "gpu": transport.gpu_identity(cupy) if placement.gpu is not None else None,
    }
    if cupy is not None:
        try:
            report["cuda_runtime"] = _cuda_version(int(cupy.cuda.runtime.runtimeGetVersion()))
            report["cuda_driver"] = _cuda_version(int(cupy.cuda.runtime.driverGetVersion()))
        except Exception as exc:
            report["cuda_runtime"] = f"unavailable ({exc})"
    nccl, version = transport.nccl_status(cupy)
    report["nccl"] = version if nccl is not None else f"not available ({version})"
    if cupy is None:
        report["nccl"] = "n/a (needs CuPy)"
    report["_cupy"] = cupy
    return report


def collect(comm: MPI.Intracomm | None = None) -> dict[str, Any] | None:
    """Everything ``mpistrat info`` shows, on rank 0 (None on the other ranks). Collective."""
    comm = (comm or MPI.COMM_WORLD).Dup()
    try:
        mine = _local_report(comm)
        cupy = mine.pop("_cupy")
        caps = transport.device_capabilities(comm, cupy)
        plan = {}
        for implementation in ("AUTO", "RING", "NCCL"):
            if cupy is None:
                plan[implementation] = f"n/a (CuPy: {mine['cupy']})"
                continue
            try:
                kind, reason = transport.choose_device_transport(implementation, caps, mine["cuda_aware"])
                plan[implementation] = f"{_KINDS[kind]} ({reason})"
            except MpistratError as exc:
                plan[implementation] = f"error: {exc}"
        mine["device_transport"] = plan
        ranks = comm.gather(mine, root=0)
    finally:
        comm.Free()
    if ranks is None:
        return None
    first = ranks[0]
    loads = host.loads([(r["host"], r["cpus"], r["logical_cores"]) for r in ranks])
    nodes: dict[str, int] = {}
    for r in ranks:
        nodes[r["host"]] = nodes.get(r["host"], 0) + 1
    return {
        "mpi_library": " ".join(MPI.Get_library_version().strip().splitlines()[0].split()),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi4py": mpi4py.__version__,
        "cuda_aware": first["cuda_aware"],
        "cuda_aware_how": first["cuda_aware_how"],
        "cuda_aware_same_everywhere": all(r["cuda_aware"] == first["cuda_aware"] for r in ranks),
        "cupy": first["cupy"],
        "cuda_runtime": first["cuda_runtime"],
        "cuda_driver": first["cuda_driver"],
        "nccl": first["nccl"],
        "size": len(ranks),
        "launch": str(launch.launched() or "no launcher (this process alone)"),
        "launch_problem": launch.problem(len(ranks)),
        "ranks_per_node": nodes,
        "cores": [str(h) for h in loads],
        "oversubscribed": [str(h) for h in loads if h.oversubscribed],
        "threads": host.threads(),
        "blas_threads": host.blas_threads(),
        "host_transport": transport.HostMPI.name,
        "step_check": step_check.describe(),
        "fault_tolerance": ulfm.fault_tolerance(),
        "device_transport": first["device_transport"],
        "ranks": ranks,
    }


def _survived(live: bool, why: str) -> str:
    return f"{'survived' if live else 'ends the job'}: {why}"


_KINDS = {"nccl": "nccl", "cuda-aware": "cuda-aware mpi", "staged": "mpi (host staging)"}


def render(info: dict[str, Any]) -> str:
    """The report as text."""
    aware = "yes" if info["cuda_aware"] else "no"
    if not info["cuda_aware_same_everywhere"]:
        aware += " on rank 0, but ranks differ (see the table)"
    per_node = ", ".join(f"{host}: {n}" for host, n in info["ranks_per_node"].items())
    cuda_line = "n/a (needs CuPy)"
    if info["cuda_runtime"]:
        cuda_line = f"runtime {info['cuda_runtime']}, driver {info['cuda_driver'] or '?'}"
    plan = info["device_transport"]
    set_ = [f"{k}={v}" for k, v in info["threads"].items()] or [
        "no thread variable set (OMP_NUM_THREADS, ...)"
    ]
    threads = ", ".join(set_) + (f"; BLAS {info['blas_threads']}" if info["blas_threads"] else "")
    lines = [
        f"MPI library       {info['mpi_library']} (MPI {info['mpi_standard']})",
        f"mpi4py            {info['mpi4py']}",
        f"CUDA-aware MPI    {aware}: {info['cuda_aware_how']}",
        f"CuPy              {info['cupy']}",
        f"CUDA              {cuda_line}",
        f"NCCL              {info['nccl']}",
        f"ranks             {info['size']} on {len(info['ranks_per_node'])} node(s) ({per_node})",
        f"launch            {info['launch']}; MPI: {info['size']} rank{'s' if info['size'] != 1 else ''}",
        f"cores             {'; '.join(info['cores'])}"
        + (" (OVERSUBSCRIBED: the ranks take turns on the cores)" if info["oversubscribed"] else ""),
        f"threads           {threads}",
        f"step check        {info['step_check']} (MPISTRAT_CHECK=step's per-call and per-step paths)",
        f"a rank's death    {_survived(*info['fault_tolerance'])}",
        f"AUTO transport    host buffers: {info['host_transport']}",
        f"                  device buffers: {plan['AUTO']}",
        f"RING transport    device buffers: {plan['RING']}",
        f"NCCL transport    device buffers: {plan['NCCL']}",
        "",
    ]
    header = ("rank", "host", "local", "CPUs", "device", "CUDA_VISIBLE_DEVICES", "CUDA-aware")
    rows = [
        (
            str(r["rank"]),
            r["host"],
            f"{r['local_rank']}/{r['local_size']}",
            "?" if r["cpus"] is None else cpu_list(r["cpus"]),
            r["device"] + (f" [{r['gpu']}]" if r["gpu"] else ""),
            "(unset)" if r["cuda_visible_devices"] is None else repr(r["cuda_visible_devices"]),
            "yes" if r["cuda_aware"] else "no",
        )
        for r in info["ranks"]
    ]
    return "\n".join(lines + columns(header, rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mpistrat info",
        description="What MPI, CUDA and transports this job sees (run under mpiexec with every rank).",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--startup",
        action="store_true",
        help="how long each rank took to reach MPI_Init, the end of import mpistrat and the first "
        "collective, and (with strace) the file system calls of a start, by location; hints at staging",
    )
    parser.add_argument("--no-trace", action="store_true", help="with --startup: do not run strace")
    parser.add_argument(
        "--health",
        action="store_true",
        help="time every node (start-up, import, compute, memory, links between nodes), flag the slow "
        "ones and print a Slurm --exclude= line; exits 1 when one is flagged",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.health:
        from mpistrat.tools import health

        return health.main(["--json"] if args.json else [])
    if args.startup:
        from mpistrat.tools import startup_info

        return startup_info.main(["--json"] * args.json + ["--no-trace"] * args.no_trace)
    try:
        info = collect()
    except MpistratError as exc:  # raised on every rank alike (e.g. a bad MPISTRAT_DEVICE)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"mpistrat info: {exc}", file=sys.stderr)
        return 1
    if info is None:
        return 0
    print(json.dumps(info, indent=2, default=str) if args.json else render(info), flush=True)
    if info["launch_problem"]:
        print(f"mpistrat info: {info['launch_problem']}", file=sys.stderr)
        return 1
    return 0
