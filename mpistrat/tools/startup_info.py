"""``mpistrat info --startup``: how long each rank took to start, and what it read from where.

    mpiexec -n 4 python -m mpistrat info --startup          # the table, on rank 0
    mpiexec -n 4 python -m mpistrat info --startup --json   # every rank's record

Per rank, seconds from the process's start (the kernel's start time) to ``MPI_Init``, to the
end of ``import mpistrat`` and to the first collective (the creation of the strategy the command
makes, after its own imports), and the reads made by then (``/proc/self/io``). Where ``strace``
is installed, a fresh interpreter beside each rank does the same under ``strace -f -e
trace=%file`` (MPI started alone): its file system calls, by location. A location is
``shared`` (a network or parallel file system: NFS, Lustre, GPFS, BeeGFS, ...; or under
``MPISTRAT_SHARED_PATHS``), ``node-local`` (a local disk, ``/dev/shm``, ``$TMPDIR``) or
``kernel`` (``/proc``, ``/sys``); ``environment`` counts those in the interpreter's
environment (its prefix, base prefix and mpistrat). Rank 0 prints each rank, the median and the
slowest, and a hint when the environment is on a shared file system and not staged
(``mpistrat stage``; docs/scaling.md).

>>> kind_of("/proc/self/stat", [("/proc", "proc"), ("/", "ext4")])  # mounts(): the longest first
'kernel'
>>> line = '7 openat(AT_FDCWD, "/proc/self/io", O_RDONLY) = 3</proc/7/io>'
>>> calls_by_location([line], [("/proc", "proc")], environment=())
{'calls': 1, 'shared': 0, 'node-local': 0, 'kernel': 1, 'environment': 0}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mpi4py import MPI

from mpistrat import config
from mpistrat.diagnostics import launch, startup
from mpistrat.tools.columns import columns

__all__ = ["calls_by_location", "collect", "environment", "kind_of", "main", "of_job", "render", "summarize"]

# File systems whose files every node reads over the network: metadata goes to a shared server.
SHARED = {
    "nfs", "nfs4", "lustre", "gpfs", "beegfs", "fhgfs", "cifs", "smb3", "ceph", "fuse.ceph", "panfs",
    "wekafs", "pvfs2", "orangefs", "glusterfs", "fuse.glusterfs", "afs", "dvs", "fuse.sshfs",
    "fuse.cvmfs", "quobyte", "fuse.quobyte", "9p",
}  # fmt: skip
KERNEL = {
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "securityfs", "tracefs",
    "bpf", "mqueue", "hugetlbfs", "configfs", "fusectl", "pstore",
}  # fmt: skip
STAGED = "mpistrat-stage.json"  # what `mpistrat stage` leaves in a staged environment's prefix
PROBE = (
    "import numpy, mpistrat; s = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF); "
    "s.run(lambda: mpistrat.get_replica_context().all_reduce('sum', numpy.ones(2)))"
)
PROBE_LIMIT = 300.0  # seconds before the traced interpreter counts as hung
_PATH = re.compile(r'"((?:[^"\\]|\\.)*)"')  # the first quoted argument of a strace line
_FD = re.compile(r"\((?:\d+|AT_FDCWD)<([^>]*)>")  # a descriptor strace -y annotated with its path


def mounts() -> list[tuple[str, str]]:
    """(mount point, file system type) of each mount this process sees, longest mount point first."""
    found = []
    try:
        with open("/proc/self/mountinfo") as info:
            for line in info:
                fields = line.split()
                point = re.sub(r"\\(\d{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
                found.append((point, fields[fields.index("-") + 1]))
    except (OSError, ValueError, IndexError):
        return [("/", "unknown")]
    return sorted(found, key=lambda m: len(m[0]), reverse=True)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def file_system(path: str, table: Sequence[tuple[str, str]]) -> str:
    """The type of the file system ``path`` is on: the first mount point of ``table`` above it (the
    longest, in :func:`mounts`' order)."""
    return next((kind for point, kind in table if _under(path, point)), "unknown")


def kind_of(path: str, table: Sequence[tuple[str, str]], shared: Iterable[str] = ()) -> str:
    """``shared``, ``node-local`` or ``kernel``: where a call on ``path`` goes."""
    if any(_under(path, p) for p in shared):
        return "shared"
    kind = file_system(path, table)
    return "shared" if kind in SHARED else "kernel" if kind in KERNEL else "node-local"


def _shared_paths() -> list[str]:
    return [p for p in (config.read("MPISTRAT_SHARED_PATHS") or "").split(":") if p]


def environment() -> dict[str, Any]:
    """Where this interpreter's environment lives: its prefix, base prefix and mpistrat (each path,
    its file system and kind), and what ``mpistrat stage`` recorded when it staged it (else None)."""
    import mpistrat

    table, shared = mounts(), _shared_paths()
    places = {
        "prefix": sys.prefix,
        "base_prefix": sys.base_prefix,
        "mpistrat": str(Path(mpistrat.__file__).parent),
    }
    staged = None
    with contextlib.suppress(OSError, ValueError):
        staged = json.loads((Path(sys.prefix) / STAGED).read_text())
    return {
        **{
            name: {
                "path": path,
                "file_system": file_system(path, table),
                "kind": kind_of(path, table, shared),
            }
            for name, path in places.items()
        },
        "staged": staged,
    }


def calls_by_location(
    lines: Iterable[str],
    table: Sequence[tuple[str, str]],
    environment: Sequence[str],
    shared: Iterable[str] = (),
) -> dict[str, int]:
    """The file system calls of ``strace -f -y -e trace=%file`` output lines, counted by location."""
    counts = {"calls": 0, "shared": 0, "node-local": 0, "kernel": 0, "environment": 0}
    shared = list(shared)
    for line in lines:
        if "(" not in line or line.lstrip(" 0123456789").startswith(("+++", "---")):
            continue
        quoted, fd = _PATH.search(line), _FD.search(line)
        path = quoted.group(1) if quoted else ""
        if not path.startswith("/"):  # "" with a descriptor, a path relative to one, or none (getcwd)
            base = fd.group(1) if fd else os.getcwd()
            path = os.path.join(base, path) if path else base
        counts["calls"] += 1
        counts[kind_of(path, table, shared)] += 1
        counts["environment"] += any(_under(path, p) for p in environment)
    return counts


def traced_calls() -> dict[str, int] | None:
    """A fresh interpreter's start (import mpistrat, a strategy, one all_reduce; MPI started alone)
    under strace, its file system calls by location; None without strace, or if it failed."""
    strace = shutil.which("strace")
    if strace is None:
        return None
    env = environment()
    places = [env[name]["path"] for name in ("prefix", "base_prefix", "mpistrat")]
    with tempfile.TemporaryDirectory(prefix="mpistrat-startup-") as work:
        out = Path(work) / "trace"
        command = [
            strace,
            "-f",
            "-y",
            "-qq",
            "-e",
            "trace=%file",
            "-o",
            str(out),
            sys.executable,
            "-c",
            PROBE,
        ]
        try:
            done = subprocess.run(
                command, env=launch.outside_launch(), capture_output=True, timeout=PROBE_LIMIT
            )
            if done.returncode != 0 or not out.exists():
                return None
            with open(out, errors="replace") as lines:
                return calls_by_location(lines, mounts(), places, _shared_paths())
        except (OSError, subprocess.SubprocessError):
            return None


def local(trace: bool) -> dict[str, Any]:
    """This rank's record: its start (``diagnostics/startup.py``), where it read from, and the traced
    calls of a fresh start beside it."""
    return {
        "rank": MPI.COMM_WORLD.Get_rank(),
        "host": MPI.Get_processor_name(),
        **startup.record(),
        "environment": environment(),
        "traced": traced_calls() if trace else None,
    }


def of_job(comm: MPI.Intracomm) -> dict[str, Any]:
    """What a benchmark's results keep of its start (collective): each rank's points and reads, their
    summary, and where rank 0's environment lives (staged or not)."""
    mine = {"rank": comm.Get_rank(), **startup.record()}
    ranks = comm.allgather({key: mine[key] for key in ("rank", "points", "reads")})
    return {"summary": summarize(ranks), "environment": environment(), "ranks": ranks}


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """For each point and each traced count: the median over the ranks and the slowest rank."""
    out: dict[str, Any] = {}
    for point in startup.POINTS:
        seen = [(r["points"][point], r["rank"]) for r in ranks if r["points"].get(point) is not None]
        if seen:
            slowest = max(seen)
            out[point] = {
                "median": statistics.median(s for s, _ in seen),
                "slowest": slowest[0],
                "rank": slowest[1],
            }
    traced = [r["traced"] for r in ranks if r.get("traced")]
    if traced:
        out["traced"] = {
            key: {"median": statistics.median(t[key] for t in traced), "max": max(t[key] for t in traced)}
            for key in traced[0]
        }
    return out


def hint(ranks: list[dict[str, Any]]) -> str | None:
    """Advice when a rank's environment is on a shared file system and not staged."""
    for r in ranks:
        env = r["environment"]
        shared = [name for name in ("prefix", "base_prefix", "mpistrat") if env[name]["kind"] == "shared"]
        if shared and env["staged"] is None:
            where = ", ".join(f"{env[n]['path']} ({env[n]['file_system']})" for n in shared)
            return (
                f"the environment is on a shared file system ({where}, rank {r['rank']}) and not staged: "
                "every rank reads it there at start. At many ranks, stage it on each node: STAGE=1 in jobs/ "
                "(made once by `mpistrat stage --pack`; docs/scaling.md)"
            )
    return None


def collect(trace: bool = True) -> dict[str, Any] | None:
    """Every rank's record, and their summary, on rank 0 (None elsewhere). Collective over COMM_WORLD:
    it makes an ``MPIStrategy``, the first collective of the command."""
    import mpistrat

    strategy = mpistrat.MPIStrategy()
    ranks = MPI.COMM_WORLD.gather(local(trace), root=0)
    strategy.experimental_finalize()
    if ranks is None:
        return None
    return {"size": len(ranks), "summary": summarize(ranks), "hint": hint(ranks), "ranks": ranks}


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render(info: dict[str, Any]) -> str:
    """The report as text: a line per point and traced count, then a row per rank."""
    summary = info["summary"]
    lines = [f"start of {info['size']} rank(s), seconds since each process started (median, slowest rank):"]
    for point in startup.POINTS:
        if point in summary:
            s = summary[point]
            lines.append(f"  {point:<17} {s['median']:8.3f}  {s['slowest']:8.3f} (rank {s['rank']})")
        else:
            lines.append(
                f"  {point:<17} -  (MPI was started before mpistrat was imported)"
                if point == "MPI_Init"
                else f"  {point:<17} -"
            )
    if "traced" in summary:
        counts = summary["traced"]
        lines.append("file system calls of a fresh start per rank, traced (median, max):")
        for key in ("calls", "shared", "node-local", "kernel", "environment"):
            lines.append(f"  {key:<17} {counts[key]['median']:8.0f}  {counts[key]['max']:8.0f}")
    else:
        lines.append("file system calls: not traced (strace is not installed, or --no-trace)")
    env = info["ranks"][0]["environment"]
    staged = env["staged"]
    prefix = env["prefix"]
    lines.append(
        f"environment (rank 0) {prefix['path']} on {prefix['file_system']} ({prefix['kind']}); "
        + (f"staged from {staged.get('prefix')}" if staged else "not staged")
    )
    if info["hint"]:
        lines.append(f"hint: {info['hint']}")
    lines.append("")
    header = ("rank", "host", "MPI_Init", "import", "first collective", "read calls", "traced calls")
    rows = [
        (
            str(r["rank"]),
            r["host"],
            *(_seconds(r["points"][p]) for p in startup.POINTS),
            "-" if not r["reads"] else str(r["reads"].get("syscr", "-")),
            "-" if not r["traced"] else str(r["traced"]["calls"]),
        )
        for r in info["ranks"]
    ]
    return "\n".join(lines + columns(header, rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mpistrat info --startup",
        description="How long each rank took to start, and what it read from where (run under mpiexec).",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-trace", action="store_true", help="do not trace a fresh start with strace")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    info = collect(trace=not args.no_trace)
    if info is not None:
        print(json.dumps(info, indent=2) if args.json else render(info), flush=True)
    return 0
