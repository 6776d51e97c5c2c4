"""When this process reached each point of its start, for ``mpistrat info --startup``.

Importing this module starts MPI (mpi4py initializes it when imported), as ``import mpistrat``
always has, and notes when MPI was up; ``mpistrat/__init__.py`` notes the end of ``import
mpistrat``, and the first strategy the end of its creation handshake, the program's first
collective. :func:`record` gives each point in seconds since the process started (the kernel's
start time, ``/proc``), the reads the process made by then (``/proc/self/io``), and where
mpistrat and its environment were read from.

>>> sorted(record()["points"]) == sorted(POINTS)
True
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

__all__ = ["POINTS", "process_age", "reached", "reads", "record"]

POINTS = ("MPI_Init", "import mpistrat", "first collective")
_reached: dict[str, float] = {}  # point -> time.monotonic() when first reached
_reads: dict[str, int] | None = None  # /proc/self/io at the first collective


def reached(point: str) -> None:
    """Note that this process reached ``point`` now (the first time counts); at the first collective,
    read ``/proc/self/io`` too (one read of a node-local file)."""
    global _reads
    if point in _reached:
        return
    _reached[point] = time.monotonic()
    if point == "first collective":
        _reads = reads()


def _start_mpi() -> None:
    """Import mpi4py.MPI, which initializes MPI, and note when it returned; nothing where the program
    had imported it before mpistrat (MPI was up before `import mpistrat` began, when is unknown)."""
    if "mpi4py.MPI" in sys.modules:
        return
    import mpi4py.MPI

    if mpi4py.MPI.Is_initialized():  # not under MPI4PY_RC_INITIALIZE=0
        reached("MPI_Init")


def process_age() -> float | None:
    """Seconds since this process started, from the kernel's start time (Linux; None elsewhere)."""
    try:
        with open("/proc/self/stat") as stat:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as uptime:
            now = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return now - start_ticks / os.sysconf("SC_CLK_TCK")


def reads() -> dict[str, int] | None:
    """This process's reads so far (``/proc/self/io``: ``syscr`` read calls, ``rchar`` bytes,
    ``read_bytes`` from storage); None where the kernel does not tell."""
    try:
        with open("/proc/self/io") as io:
            fields = dict(line.split(":") for line in io.read().splitlines())
    except (OSError, ValueError):
        return None
    return {name: int(fields[name]) for name in ("syscr", "rchar", "read_bytes") if name in fields}


def record() -> dict[str, Any]:
    """Each point reached, in seconds since the process started (None: not reached, or the start
    is unknown), and the reads by the first collective."""
    age, now = process_age(), time.monotonic()
    points = {
        point: None if age is None or point not in _reached else round(age - (now - _reached[point]), 4)
        for point in POINTS
    }
    return {
        "age": None if age is None else round(age, 4),
        "points": points,
        "mpi_before_mpistrat": "MPI_Init" not in _reached,
        "reads": _reads,
    }


_start_mpi()
