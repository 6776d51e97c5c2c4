"""What ``mpistrat info --health`` makes of its measurements: a row per node, the slow ones, an exclude line.

Pure functions over the ranks' records (``tools/health.py`` measures them), so they are tested
without MPI. Each node's value is its middle rank's (the faster of two), so one rank unlucky on
a busy node does not flag it; an exchange between nodes counts for a node by its best link,
since a bad node makes every one of its links slow and a good one has some good link. Every
metric is compared as a time: a node beyond :data:`FACTOR` times the median node (the lower
middle value for an even count, so one slow node of two is found), and beyond it by more than
the metric's resolution, is flagged.

>>> ranks = [dict(host=h, imported=0.5, gflops=g, gbps=10.0, links={})
...          for h, g in (("a", 10.0), ("a", 9.0), ("b", 1.0), ("b", 1.5))]
>>> nodes = per_node(ranks)
>>> flagged(nodes)
{'b': ['compute']}
>>> exclude_line(flagged(nodes))
'--exclude=b'
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

__all__ = ["FACTOR", "JOB", "METRICS", "Metric", "exclude_line", "flagged", "job", "per_node", "render"]

FACTOR = 3.0  # a node this many times slower than the median node is flagged


@dataclasses.dataclass(frozen=True)
class Metric:
    """One column: ``key`` in a node's row, how it reads, and how it compares (as seconds)."""

    key: str
    label: str
    about: str
    rate: bool  # a rate (higher is better): compared as its inverse
    resolution: float  # seconds (or seconds per unit) below which a difference is noise

    def seconds(self, value: float | None) -> float | None:
        """The value as a time: rates become their inverse (0 or missing: unknown)."""
        if value is None:
            return None
        if self.rate:
            return math.inf if value <= 0 else 1.0 / value
        return value


_NEIGHBOUR = "one-way time of a {} message to a neighbouring node (its best link)"
METRICS = (
    Metric("imported", "import s", "a fresh interpreter importing mpistrat (MPI not started)", False, 0.25),
    Metric("compute", "GFLOP/s", "float64 multiply-adds on an in-cache array for 0.5 s", True, 0.02),
    Metric("memory", "GB/s", "copying 32 MiB arrays for 0.3 s", True, 0.01),
    Metric("small", "4 B us", _NEIGHBOUR.format("4-byte"), False, 20e-6),
    Metric("large", "4 MiB ms", _NEIGHBOUR.format("4 MiB"), False, 1e-3),
)
# Measured on every rank but the same for all: MPI_Init and MPIStrategy() wait for the last rank.
JOB = {
    "startup": "start-up: launch, interpreter, imports and MPI_Init, to the check's first line",
    "strategy": "MPIStrategy()",
}


def per_node(ranks: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each node's row (host -> metric -> value) from every rank's record, in the ranks' order.

    A rank's record holds ``host``, ``imported`` (seconds; None: it failed), ``gflops``, ``gbps``
    (the rates) and, on a node's leader, ``links`` (the other node -> (4 B, 4 MiB) one-way seconds).
    """
    values: dict[str, dict[str, list[float | None]]] = {}
    links: dict[str, list[tuple[float, float]]] = {}
    for r in ranks:
        mine = values.setdefault(r["host"], {m.key: [] for m in METRICS[:3]})
        for key, field in (("imported", "imported"), ("compute", "gflops"), ("memory", "gbps")):
            mine[key].append(r[field])
        links.setdefault(r["host"], [])
        for other, (small, large) in r["links"].items():
            links[r["host"]].append((small, large))
            links.setdefault(other, []).append((small, large))
    rows: dict[str, dict[str, float | None]] = {}
    for host, mine in values.items():
        rows[host] = {m.key: _middle(m, mine[m.key]) for m in METRICS[:3]}
        rows[host]["small"] = min((t[0] for t in links[host]), default=None)
        rows[host]["large"] = min((t[1] for t in links[host]), default=None)
    return rows


def _middle(metric: Metric, values: list[float | None]) -> float:
    """The node's middle rank by time (the faster of two): one unlucky rank does not make a node slow,
    a slow node's ranks are all slow. A rank whose probe failed counts as infinitely slow."""
    known = [metric.seconds(v) for v in values]
    t = statistics.median_low(sorted(math.inf if t is None else t for t in known))
    return 1.0 / t if metric.rate else t  # a failed probe: an infinite time, a zero rate


def job(ranks: list[dict[str, Any]]) -> dict[str, float | None]:
    """The job's start-up and strategy creation (seconds): the slowest rank's, as every rank waits for it."""
    return {key: max((r[key] for r in ranks if r.get(key) is not None), default=None) for key in JOB}


def flagged(nodes: dict[str, dict[str, float | None]]) -> dict[str, list[str]]:
    """Host -> the metrics in which it is beyond ``FACTOR`` times the median node (as times)."""
    found: dict[str, list[str]] = {}
    if len(nodes) < 2:
        return found
    for metric in METRICS:
        times = {h: metric.seconds(row.get(metric.key)) for h, row in nodes.items()}
        known = [t for t in times.values() if t is not None]
        if len(known) < 2:
            continue
        median = statistics.median_low(known)
        for host, t in times.items():
            if t is not None and t > FACTOR * median and t - median > metric.resolution:
                found.setdefault(host, []).append(metric.key)
    return found


def exclude_line(found: dict[str, list[str]]) -> str:
    """Slurm's option to leave the flagged nodes out of the next allocation."""
    return f"--exclude={','.join(sorted(found))}"


def _cell(metric: Metric, value: float | None) -> str:
    if value is None:
        return "-"
    if metric.key == "small":
        return f"{value * 1e6:.1f}"
    if metric.key == "large":
        return f"{value * 1e3:.2f}"
    return f"{value:.2f}" if not math.isinf(value) else "inf"


def render(
    nodes: dict[str, dict[str, float | None]],
    found: dict[str, list[str]],
    ranks: int,
    whole: dict[str, float | None] | None = None,
) -> str:
    """The table, a line per metric saying what it measures, the job's times, and the verdict."""
    header = ["node", *(m.label for m in METRICS), ""]
    mark = {host: "<- slow: " + ", ".join(keys) for host, keys in found.items()}
    rows = [
        [host, *(_cell(m, row.get(m.key)) for m in METRICS), mark.get(host, "")]
        for host, row in nodes.items()
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [f"health of {len(nodes)} node(s), {ranks} rank(s): each node's middle rank"]
    for row in [header, *rows]:
        lines.append(
            "  ".join(
                cell.rjust(w) if i else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
    lines += ["", *(f"  {m.label:<11} {m.about}" for m in METRICS), ""]
    for key, about in JOB.items():
        seconds = (whole or {}).get(key)
        if seconds is not None:
            lines.append(f"{about}: {seconds:.2f} s (every rank waits for the last, so not per node)")
    if len(nodes) < 2:
        lines.append("one node: nothing to compare it with")
    elif found:
        slow = f"{len(found)} node(s) beyond {FACTOR:g}x the median node"
        lines.append(f"{slow}; leave them out with {exclude_line(found)}")
    else:
        lines.append(f"no node beyond {FACTOR:g}x the median node")
    return "\n".join(lines)
