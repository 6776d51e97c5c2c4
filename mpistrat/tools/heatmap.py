"""The rank x time heat map of imposed wait that ``mpistrat plot`` draws from a timeline.

A rank's imposed wait at a handshake is how much later than the first rank it arrived
(``late_ms``, set by ``mpistrat timeline``): the time the earliest rank spent waiting for
it. Summed per time bin, a straggling rank is the bright row.

>>> trace = {"traceEvents": [
...     {"ph": "X", "cat": "handshake", "pid": 0, "ts": 0.0, "dur": 20e3, "args": {"late_ms": 0.0}},
...     {"ph": "X", "cat": "handshake", "pid": 1, "ts": 20e3, "dur": 0.0, "args": {"late_ms": 20.0}},
...     {"ph": "X", "cat": "handshake", "pid": 1, "ts": 90e3, "dur": 0.0, "args": {"late_ms": 5.0}}]}
>>> ranks, edges, grid = imposed_grid(trace, bins=2)
>>> ranks, [round(e / 1e3) for e in edges], grid
([0, 1], [0, 45, 90], [[0.0, 0.0], [20.0, 5.0]])
"""

from __future__ import annotations

import json
import os
from typing import Any

from mpistrat.errors import InvalidArgumentError

__all__ = ["draw", "imposed_grid", "read_trace"]


def read_trace(path: str) -> dict[str, Any]:
    """A merged trace (``mpistrat timeline -o``), or a timeline directory merged now."""
    if os.path.isdir(path):
        from mpistrat.tools.merge_timelines import merge

        return merge(path)
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise InvalidArgumentError(f"{path} is not a trace from `mpistrat timeline` (no traceEvents)")
    return trace


def is_timeline(path: str) -> bool:
    """Whether ``path`` is a timeline directory or a merged trace (not a bench results file)."""
    if os.path.isdir(path):
        return True
    try:
        with open(path, encoding="utf-8") as f:
            return '"traceEvents"' in f.read(4096)
    except OSError:
        return False


def imposed_grid(
    trace: dict[str, Any], bins: int | None = None
) -> tuple[list[int], list[float], list[list[float]]]:
    """(ranks, bin edges in µs, imposed wait in ms per rank per bin) from the handshakes' ``late_ms``.

    ``bins`` None: up to 100, about three handshakes per rank in each. The handshake of a
    strategy's creation is left out: ranks reach it as they start up.
    """
    shakes = [
        e
        for e in trace["traceEvents"]
        if e.get("ph") == "X"
        and e.get("cat") == "handshake"
        and e.get("args", {}).get("kind") != "strategy creation"
    ]
    if not shakes:
        raise InvalidArgumentError("the trace has no handshakes (was the check off, or no collective run?)")
    ranks = sorted({int(e["pid"]) for e in trace["traceEvents"] if e.get("ph") == "X"})
    if bins is None:
        bins = max(1, min(100, len(shakes) // (3 * len(ranks))))
    ends = [e["ts"] + e["dur"] for e in shakes]
    t0, t1 = min(e["ts"] for e in shakes), max(ends)
    width = (t1 - t0) / bins or 1.0
    grid = [[0.0] * bins for _ in ranks]
    row = {r: i for i, r in enumerate(ranks)}
    for e, end in zip(shakes, ends, strict=True):
        b = min(int((end - t0) / width), bins - 1)
        grid[row[int(e["pid"])]][b] += float(e.get("args", {}).get("late_ms", 0.0))
    return ranks, [t0 + i * width for i in range(bins + 1)], grid


def draw(plt: Any, trace: dict[str, Any], bins: int | None = None) -> Any:
    """The heat map: one row per rank, time across, colour the wait it imposed."""
    ranks, edges, grid = imposed_grid(trace, bins)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.35 * len(ranks)))
    seconds = [e / 1e6 for e in edges]
    rows = [r - 0.5 for r in ranks] + [ranks[-1] + 0.5]
    mesh = ax.pcolormesh(seconds, rows, grid, cmap="magma", shading="flat")
    ax.set_yticks(ranks)
    ax.set_ylabel("rank")
    ax.set_xlabel("time (s)")
    ax.invert_yaxis()
    ax.set_title("imposed wait: how much later than the first rank each rank arrived")
    fig.colorbar(mesh, ax=ax, label=f"ms per bin ({(edges[1] - edges[0]) / 1e3:.3g} ms)")
    return fig
