"""``mpistrat timeline DIR -o trace.json``: merge the ranks' timelines into one Chrome trace.

Each rank's file (``MPISTRAT_TIMELINE=DIR``) has times of its own monotonic clock; on
several nodes those clocks differ by anything. Every rank leaves a handshake (an
all-reduce) within microseconds of the others, so a rank's clock offset is the median
over shared handshakes of (its leaving time - a reference rank's). Ranks that share no
communicator with rank 0 are aligned through one that does.

The result opens in https://ui.perfetto.dev or ``chrome://tracing``: one process per
rank, collectives with their call site, bytes, handshake and transfer times, and the
program's spans. Each handshake event also gets ``late_ms``: how much later than the
first rank this rank arrived, the wait it imposed (what ``mpistrat plot`` draws).

>>> merged = merge_ranks({0: [_hs(1, 10.0, 0.5)], 1: [_hs(1, 110.2, 0.3)]})  # rank 1's clock is +100 s
>>> [round(e["ts"]) for e in merged if e["ph"] == "X"]  # microseconds after the first event
[0, 200000]
>>> [e["args"]["late_ms"] for e in merged if e["ph"] == "X"]
[0.0, 200.0]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from typing import Any

from mpistrat.errors import InvalidArgumentError

__all__ = ["load", "main", "merge", "merge_ranks"]


def _hs(seq: int, ts: float, dur: float, comm: str = "0+2#0") -> dict[str, Any]:
    """A handshake event as a rank's file has it (for examples)."""
    args = {"comm": comm, "seq": seq}
    return {"cat": "handshake", "name": "handshake", "ts": ts, "dur": dur, "tid": 0, "args": args}


def load(
    directory: str, notes: list[str] | None = None
) -> tuple[dict[int, dict[str, Any]], dict[int, list[dict[str, Any]]]]:
    """Every rank's header and events from ``directory``.

    A line that is not JSON is left out and said in ``notes``: the last one is what a write that
    failed part-way leaves ("the timeline stopped"), and every complete line before it still counts.
    """
    paths = sorted(glob.glob(os.path.join(directory, "rank-*.jsonl")))
    if not paths:
        raise InvalidArgumentError(f"no rank-*.jsonl files in {directory!r} (MPISTRAT_TIMELINE's directory)")
    headers, events = {}, {}
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = [line for line in f if line.strip()]
        lines, bad = [], []
        for number, line in enumerate(text, 1):
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                bad.append(number)
        if not lines or bad[:1] == [1] or lines[0].get("format") != "mpistrat-timeline-1":
            raise InvalidArgumentError(f"{path} is not an mpistrat timeline (no header line)")
        if notes is not None and bad:
            notes.append(_cut(path, bad, len(text)))
        rank = int(lines[0]["rank"])
        headers[rank], events[rank] = lines[0], lines[1:]
    return headers, events


def _cut(path: str, bad: list[int], total: int) -> str:
    name = os.path.basename(path)
    if bad == [total]:
        return (
            f"{name}: its last line was cut (a write that failed part-way: the timeline stopped); "
            f"merged the {total - 1} complete lines"
        )
    shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
    return f"{name}: left out {len(bad)} line(s) that are not JSON (lines {shown})"


def _handshake_ends(events: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """A rank's handshakes by (communicator, seq, kind, occurrence): the same key on every member."""
    found: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in events:
        if e.get("cat") != "handshake":
            continue
        a = e.get("args", {})
        key = (a.get("comm"), a.get("seq"), a.get("kind"))
        n = 0
        while (*key, n) in found:
            n += 1
        index = (*key, n)  # a starred subscript needs Python 3.11
        found[index] = e
    return found


def _end(event: dict[str, Any]) -> float:
    return event["ts"] + event["dur"]


def offsets(events: dict[int, list[dict[str, Any]]]) -> dict[int, float]:
    """Each rank's clock minus the reference rank's (the lowest), by the handshakes they share."""
    shakes = {r: _handshake_ends(ev) for r, ev in events.items()}
    ranks = sorted(events)
    known = {ranks[0]: 0.0}
    progress = True
    while progress and len(known) < len(ranks):
        progress = False
        for r in ranks:
            if r in known:
                continue
            for k in list(known):
                shared = shakes[r].keys() & shakes[k].keys()
                if shared:
                    diffs = [_end(shakes[r][s]) - _end(shakes[k][s]) for s in shared]
                    known[r] = known[k] + statistics.median(diffs)
                    progress = True
                    break
    for r in ranks:  # no shared handshake (no collective, or the check off): leave the clock as it is
        known.setdefault(r, 0.0)
    return known


def _lateness(events: dict[int, list[dict[str, Any]]]) -> None:
    """Set ``late_ms`` on each handshake: the longest wait among its ranks minus this rank's."""
    shakes = {r: _handshake_ends(ev) for r, ev in events.items()}
    keys = set().union(*(s.keys() for s in shakes.values())) if shakes else set()
    for key in keys:
        members = [s[key] for s in shakes.values() if key in s]
        longest = max(e["dur"] for e in members)
        for e in members:
            e.setdefault("args", {})["late_ms"] = round((longest - e["dur"]) * 1e3, 6)


def merge_ranks(
    events: dict[int, list[dict[str, Any]]], headers: dict[int, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Chrome trace events (``ts``/``dur`` in µs from the first event) from every rank's events."""
    _lateness(events)
    shift = offsets(events)
    starts = [e["ts"] - shift[r] for r, ev in events.items() for e in ev]
    t0 = min(starts) if starts else 0.0
    out: list[dict[str, Any]] = []
    for r in sorted(events):
        host = (headers or {}).get(r, {}).get("host")
        name = f"rank {r}" + (f" ({host})" if host else "")
        out.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": name}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for e in events[r]:
            out.append(
                {
                    "name": e["name"],
                    "cat": e.get("cat", ""),
                    "ph": "X",
                    "ts": round((e["ts"] - shift[r] - t0) * 1e6, 3),
                    "dur": round(e["dur"] * 1e6, 3),
                    "pid": r,
                    "tid": e.get("tid", 0),
                    "args": e.get("args", {}),
                }
            )
    return out


def merge(directory: str) -> dict[str, Any]:
    """The Chrome trace (a JSON object) of the timelines in ``directory``; what was left out of it
    (a line cut short) is in ``otherData["notes"]``."""
    notes: list[str] = []
    headers, events = load(directory, notes)
    return {
        "traceEvents": merge_ranks(events, headers),
        "displayTimeUnit": "ms",
        "otherData": {"ranks": len(events), "source": os.path.abspath(directory), "notes": notes},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="mpistrat timeline", description="Merge the ranks' MPISTRAT_TIMELINE files into one trace."
    )
    p.add_argument("directory", help="the MPISTRAT_TIMELINE directory")
    p.add_argument("-o", "--output", default="trace.json", help="the Chrome/Perfetto trace to write")
    args = p.parse_args(argv)
    try:
        trace = merge(args.directory)
    except InvalidArgumentError as exc:
        p.error(str(exc))
    for note in trace["otherData"]["notes"]:
        print(f"mpistrat timeline: {note}", file=sys.stderr)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(trace, f)
    n = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    print(f"{args.output}: {n} events from {trace['otherData']['ranks']} ranks; open it in ui.perfetto.dev")
    return 0
