"""What else ran on each host while ``mpistrat bench`` timed: load average, CPU steal, other processes.

Times taken beside other work are that work's, not mpistrat's: at a load of 10 a 4-byte
``all_reduce`` averaged 1,476 us beside a median of 320 us. So before and after the sweep
each host's first rank reads

- the load average (``os.getloadavg``: runnable processes over the last 1, 5, 15 minutes);
- the CPU time counters of ``/proc/stat`` for the cores its ranks may run on (busy, idle and
  steal: what the hypervisor gave to other guests), Linux only;

and every rank its own CPU time. From them, per host: ``others``, the cores other processes
kept busy on the ranks' cores during the sweep (their busy time, less the ranks' own CPU time,
over the sweep's seconds), and ``steal``, the fraction of those cores' time stolen.

A host is warned about (:func:`warnings`) when the load average before the sweep, or the
others' cores during it, exceed the cores the ranks leave free (the host's logical cores, or
the ranks' cores, less the ranks) by more than :data:`SLACK`.

>>> assess(Reading(0.0, 4.0, [0.2, 0.1, 0.0], Ticks(1000, 600, 0)),
...        Reading(10.0, 24.0, [2.1, 0.6, 0.2], Ticks(3000, 600, 100)), cores=2)
{'seconds': 10.0, 'others_cores': 0.0, 'steal': 0.05}
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from mpi4py import MPI

from mpistrat.tools import host

__all__ = ["SLACK", "Reading", "Ticks", "Watch", "assess", "ticks", "warnings"]

# Cores of load beyond the free ones that go unremarked (a daemon's wake-ups, a shell's prompt).
SLACK = 0.5


@dataclasses.dataclass(frozen=True)
class Ticks:
    """CPU time of a set of cores in clock ticks, from ``/proc/stat``: all of it, idle (with
    iowait), and stolen (0 where the kernel does not count it)."""

    total: int
    idle: int
    steal: int


@dataclasses.dataclass(frozen=True)
class Reading:
    """One moment on one host: the time, its ranks' CPU seconds, the load average, its cores' ticks,
    its logical cores."""

    time: float
    ranks_cpu: float
    loadavg: list[float] | None
    ticks: Ticks | None
    logical_cores: int | None = None


def ticks(cpus: list[int] | None, root: Path = Path("/")) -> Ticks | None:
    """The summed ticks of ``cpus`` (None: every CPU), or None where ``/proc/stat`` is not there."""
    try:
        lines = (root / "proc/stat").read_text().splitlines()
    except OSError:
        return None
    total = idle = steal = 0
    wanted = None if cpus is None else {f"cpu{c}" for c in cpus}
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or (wanted is not None and name not in wanted):
            continue
        # user nice system idle iowait irq softirq steal [guest guest_nice: already in user]
        values = [int(v) for v in fields[:8]]
        total += sum(values)
        idle += values[3] + (values[4] if len(values) > 4 else 0)
        steal += values[7] if len(values) > 7 else 0
    return Ticks(total, idle, steal) if total else None


def _loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:  # not every platform has it
        return None


def assess(start: Reading, end: Reading, cores: int, hz: int = 100) -> dict[str, Any]:
    """What a host's two readings say of the sweep between them: its seconds, the cores other
    processes kept busy on the ranks' ``cores`` (None without ticks), the fraction stolen."""
    seconds = end.time - start.time
    out: dict[str, Any] = {"seconds": round(seconds, 3), "others_cores": None, "steal": None}
    if start.ticks is None or end.ticks is None or seconds <= 0:
        return out
    total = end.ticks.total - start.ticks.total
    busy = total - (end.ticks.idle - start.ticks.idle) - (end.ticks.steal - start.ticks.steal)
    ranks = end.ranks_cpu - start.ranks_cpu
    out["others_cores"] = round(max(0.0, (busy / hz - ranks) / seconds), 2)
    out["steal"] = round((end.ticks.steal - start.ticks.steal) / total, 4) if total > 0 else 0.0
    return out


@dataclasses.dataclass(frozen=True)
class _Place:
    """This rank's part in the readings: whether it reads for its host, and which cores."""

    leader: bool
    cpus: list[int] | None  # the union of the host's ranks' bindings; None: unknown (every CPU)


def _place(comm: MPI.Intracomm) -> _Place:
    """Collective: the lowest rank of each host reads for it, over its ranks' cores."""
    mine = (host.name(), host.cpus())
    everyone = comm.allgather(mine)
    rank = comm.Get_rank()
    same = [r for r, (name, _) in enumerate(everyone) if name == mine[0]]
    bound = [cpus for name, cpus in everyone if name == mine[0]]
    union = None if any(c is None for c in bound) else sorted({c for cpus in bound for c in cpus or ()})
    return _Place(rank == same[0], union)


def _read(comm: MPI.Intracomm, place: _Place) -> list[tuple[str, Reading]] | None:
    """Collective: every host's reading now, on rank 0 (None elsewhere)."""
    node = host.name()
    mine = (node, time.process_time())
    reading = None
    if place.leader:
        reading = (time.monotonic(), _loadavg(), ticks(place.cpus), os.cpu_count())
    gathered = comm.gather((mine, reading), root=0)
    if gathered is None:
        return None
    cpu: dict[str, float] = {}
    for (name, seconds), _ in gathered:
        cpu[name] = cpu.get(name, 0.0) + seconds
    readings = []
    for (name, _), found in gathered:
        if found is not None:  # a host's first rank
            when, load, counted, logical = found
            readings.append((name, Reading(when, cpu[name], load, counted, logical)))
    return readings


class Watch:
    """The readings around one sweep: made before it (collective: the first reading), :meth:`finish`
    after it (collective: the second)."""

    def __init__(self, comm: MPI.Intracomm, loads: list[host.HostLoad]):
        self.comm, self.loads = comm, {h.host: h for h in loads}
        self.place = _place(comm)
        self.first = _read(comm, self.place)

    def record(self) -> list[dict[str, Any]]:
        """Rank 0's record of the first reading (``meta['load']`` while the sweep runs)."""
        return [self._entry(name, start, None) for name, start in self.first or []]

    def finish(self) -> list[dict[str, Any]]:
        """Collective: the second reading; rank 0's record of both (others: [])."""
        second = _read(self.comm, self.place)
        if self.first is None or second is None:
            return []
        ends = dict(second)
        return [self._entry(name, start, ends.get(name)) for name, start in self.first]

    def _entry(self, name: str, start: Reading, end: Reading | None) -> dict[str, Any]:
        load = self.loads.get(name)
        entry: dict[str, Any] = {
            "host": name,
            "ranks": load.ranks if load else None,
            "cores": load.cores if load else None,
            "logical_cores": start.logical_cores,
            "loadavg_before": start.loadavg,
            "loadavg_after": end.loadavg if end else None,
        }
        if end is not None and load is not None:
            entry.update(assess(start, end, load.cores, _hz()))
        return entry


def _hz() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100


def warnings(load: list[dict[str, Any]]) -> list[str]:
    """A line for each host whose load average or other processes took cores the ranks needed."""
    out = []
    for entry in load:
        ranks = entry.get("ranks") or 0
        found = []
        before_sweep = entry.get("loadavg_before")
        machine = entry.get("logical_cores")
        if before_sweep and machine and before_sweep[0] > machine - ranks + SLACK:
            found.append(
                f"the load average was {before_sweep[0]:g} before the sweep, with {machine - ranks:g} of "
                f"its {machine} logical cores left free by the ranks"
            )
        others, cores = entry.get("others_cores"), entry.get("cores")
        if others is not None and cores and others > cores - ranks + SLACK:
            found.append(
                f"other processes kept {others:g} of the ranks' {cores} cores busy during the sweep "
                f"({max(cores - ranks, 0)} left free by the ranks)"
            )
        if not found:
            continue
        steal = entry.get("steal")
        stolen = f"; the hypervisor took {steal:.0%} of the cores' time" if steal and steal >= 0.01 else ""
        out.append(
            f"{entry['host']} was busy: {' and '.join(found)}{stolen}. The ranks waited for the cores, "
            "so the times measure that sharing, not mpistrat: time on a quiet node"
        )
    return out
