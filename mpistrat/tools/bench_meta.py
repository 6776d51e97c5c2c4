"""What a benchmark number needs beside itself to be reproduced: environment, CPU, binding, commit.

``mpistrat bench`` records these in its JSON ``meta``:

- ``environment``: the variables that steer MPI, its transports, the launcher and threading
  (see :data:`PREFIXES`), values as set on rank 0; a name holding ``TOKEN``, ``KEY``,
  ``SECRET`` or ``PASSWORD`` is never recorded;
- ``cpu``: rank 0's CPU model and logical core count;
- ``affinity``: each rank's CPU binding (``os.sched_getaffinity``) as a Linux CPU list;
- ``git_commit``: the commit mpistrat runs from when it runs from a git checkout.

>>> environment({"OMPI_MCA_btl": "^ofi", "UCX_TLS": "sm", "HOME": "/root", "NCCL_API_KEY": "x"})
{'OMPI_MCA_btl': '^ofi', 'UCX_TLS': 'sm'}
>>> cpu_list({0, 1, 2, 3, 8, 10, 11})
'0-3,8,10-11'
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["PREFIXES", "SECRET_WORDS", "affinity", "cpu", "cpu_list", "environment", "git_commit"]

PREFIXES = ("MPICH_", "OMPI_", "PMIX_", "UCX_", "FI_", "NCCL_", "SLURM_", "OMP_", "MPISTRAT_")
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


def environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``env`` (default ``os.environ``) under :data:`PREFIXES`, sorted, secrets left out."""
    env = os.environ if env is None else env
    return {
        name: env[name]
        for name in sorted(env)
        if name.startswith(PREFIXES) and not any(word in name.upper() for word in SECRET_WORDS)
    }


def cpu() -> dict[str, object]:
    """This machine's CPU model (``/proc/cpuinfo``, else ``platform``) and logical core count."""
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model", "Hardware"):
                    model = value.strip()
                    break
    except OSError:
        pass
    return {
        "model": model or platform.processor() or platform.machine() or None,
        "logical_cores": os.cpu_count(),
    }


def cpu_list(cpus: Iterable[int]) -> str:
    """CPU ids as Linux writes them (``taskset -c``, ``/proc/self/status``): ``0-3,8``."""
    ids = sorted(set(cpus))
    parts = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def affinity() -> str | None:
    """The CPUs this process may run on, or None where the OS does not say (macOS)."""
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        return None
    try:
        return cpu_list(getter(0))
    except OSError:
        return None


def git_commit(start: str | os.PathLike[str] | None = None) -> str | None:
    """The commit checked out in the git work tree holding ``start`` (default: this package), else None.

    Reads ``.git`` directly (no ``git`` process: forking under some MPI transports is unsafe),
    following a worktree's ``gitdir:`` file, a symbolic ``HEAD`` and ``packed-refs``.
    """
    here = Path(start) if start is not None else Path(__file__).resolve().parents[2]
    for folder in (here, *here.parents):
        dot = folder / ".git"
        if dot.exists():
            break
    else:
        return None
    try:
        gitdir = dot
        if dot.is_file():  # a worktree or submodule: "gitdir: PATH"
            text = dot.read_text().strip()
            if not text.startswith("gitdir:"):
                return None
            gitdir = (folder / text.split(":", 1)[1].strip()).resolve()
        common = gitdir
        if (gitdir / "commondir").is_file():
            common = (gitdir / (gitdir / "commondir").read_text().strip()).resolve()
        head = (gitdir / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head or None
        ref = head.split(":", 1)[1].strip()
        for base in (gitdir, common):
            if (base / ref).is_file():
                return (base / ref).read_text().strip() or None
        packed = common / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                sha, _, name = line.partition(" ")
                if name.strip() == ref:
                    return sha
    except OSError:
        return None
    return None
