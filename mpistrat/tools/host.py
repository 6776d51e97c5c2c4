"""What a host gives the ranks on it: logical cores and each rank's binding, memory, thread settings.

Ranks that outnumber the cores they may run on take turns on them, and a collective then
waits for a rank to be scheduled: at 4 ranks on 2 cores a 4-byte all_reduce took 5.6 ms where
2 ranks took 12 us. A time measured so is the machine's sharing, not the library's cost, so
``mpistrat bench`` warns and marks it, ``mpistrat report`` flags it, and ``mpistrat info``
shows the cores, bindings and thread settings behind it.

>>> load = HostLoad("node1", ranks=4, cores=2)
>>> load.oversubscribed, str(load)
(True, '4 ranks on 2 logical cores of node1')
>>> loads([("a", [0, 1], 8), ("a", [1, 2], 8), ("b", None, 4)])
[HostLoad(host='a', ranks=2, cores=3), HostLoad(host='b', ranks=1, cores=4)]
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from pathlib import Path

from mpi4py import MPI

__all__ = [
    "THREAD_VARIABLES",
    "HostLoad",
    "blas_threads",
    "cpus",
    "gather",
    "loads",
    "memory_available",
    "name",
    "threads",
]

# The variables that set how many threads a rank's OpenMP runtime and BLAS start.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


@dataclasses.dataclass(frozen=True)
class HostLoad:
    """The ranks on one host and the logical cores they may run on (the union of their bindings)."""

    host: str
    ranks: int
    cores: int

    @property
    def oversubscribed(self) -> bool:
        return self.ranks > self.cores

    def __str__(self) -> str:
        ranks = f"{self.ranks} rank{'s' if self.ranks != 1 else ''}"
        return f"{ranks} on {self.cores} logical core{'s' if self.cores != 1 else ''} of {self.host}"


def cpus() -> list[int] | None:
    """The logical CPUs this process may run on, or None where the OS does not say (macOS)."""
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        return None
    try:
        return sorted(getter(0))
    except OSError:
        return None


def loads(per_rank: list[tuple[str, list[int] | None, int]]) -> list[HostLoad]:
    """Each host's load from every rank's ``(host, cpus or None, os.cpu_count())``, in host order."""
    hosts: dict[str, tuple[int, set[int], int]] = {}
    for host, bound, count in per_rank:
        ranks, union, most = hosts.get(host, (0, set(), 0))
        hosts[host] = (ranks + 1, union | set(bound or ()), max(most, count))
    return [HostLoad(host, ranks, len(union) or most) for host, (ranks, union, most) in hosts.items()]


def name() -> str:
    """This host's name as MPI gives it (the names ``mpistrat info`` and bench's files use)."""
    return MPI.Get_processor_name() or socket.gethostname()


def gather(comm: MPI.Intracomm) -> list[HostLoad]:
    """Every host's load (collective: one allgather of each rank's host and binding)."""
    return loads(comm.allgather((name(), cpus(), os.cpu_count() or 1)))


def threads(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The thread-count variables that are set (:data:`THREAD_VARIABLES`)."""
    env = os.environ if env is None else env
    return {name: env[name] for name in THREAD_VARIABLES if name in env}


def blas_threads() -> str | None:
    """The threads NumPy's BLAS will start, as threadpoolctl reports them (None without it)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
    return ", ".join(f"{p.get('internal_api')}: {p.get('num_threads')}" for p in pools) or None


def memory_available(root: Path = Path("/")) -> int | None:
    """Bytes this process may still allocate: the kernel's ``MemAvailable``, or less where its
    cgroup (a Slurm job's, a container's) has a smaller limit. None where neither says (not Linux)."""
    found = [_meminfo(root), _cgroup_room(root)]
    known = [b for b in found if b is not None]
    return min(known) if known else None


def _meminfo(root: Path) -> int | None:
    try:
        text = (root / "proc/meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _cgroup_room(root: Path) -> int | None:
    """The room left under this process's cgroup memory limit (v2, else v1), if it has one."""
    try:
        entries = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for entry in entries:
        _, controllers, path = entry.split(":", 2)
        if controllers == "":  # v2
            base = root / "sys/fs/cgroup" / path.lstrip("/")
            limit, used = _number(base / "memory.max"), _number(base / "memory.current")
        elif "memory" in controllers.split(","):
            base = root / "sys/fs/cgroup/memory" / path.lstrip("/")
            limit, used = _number(base / "memory.limit_in_bytes"), _number(base / "memory.usage_in_bytes")
        else:
            continue
        if limit is not None and limit < 1 << 60:  # v1 writes "no limit" as a huge number
            return max(0, limit - (used or 0))
    return None


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit
