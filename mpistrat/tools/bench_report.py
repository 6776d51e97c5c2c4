"""Benchmark results as a table, JSON and CSV, and reading them back.

A results file is ``{"format": FORMAT, "meta": {...}, "results": [row, ...]}``; a
row holds one operation at one size, each side (``mpistrat``, ``raw`` and for some
ops ``raw2``) with ``time_us`` min/avg/max over ranks, ``algbw_GBps``,
``busbw_GBps`` and ``ok``, and ``ratio`` = mpistrat avg / raw avg. ``time_us`` also
holds ``p50`` and ``p99``: percentiles over iterations of the slowest rank's time per
iteration (``p99`` is ``None`` below :data:`P99_MIN_ITERS` timed iterations). A row's
``oversubscribed`` is true when a host ran more ranks than the cores they may use (``meta``'s
``oversubscribed`` says which: :mod:`mpistrat.tools.host`); a row is ``skewed`` (a mark, computed
from its numbers) when a side's mean is more than twice its median. ``meta``'s ``load`` holds what
else ran on each host (:mod:`mpistrat.tools.bench_load`), and ``partial`` is None once the sweep
finished, else why its rows are not all of it: ``mpistrat bench`` rewrites both files after every
row (each renamed into place whole, so a job cut at any moment leaves valid files), saying
"the sweep did not finish" until the last row, and what stopped it when a signal did.
:func:`warnings` says all of it in the words bench, report and plot share.

>>> human(4), human(65536), human(3 << 20)
('4 B', '64 KiB', '3 MiB')
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from mpistrat.errors import InvalidArgumentError

__all__ = [
    "CSV_META",
    "FORMAT",
    "OVERSUBSCRIBED",
    "P99_MIN_ITERS",
    "SKEWED",
    "block_head",
    "foot",
    "head",
    "human",
    "load",
    "oversubscription",
    "percentile",
    "row_line",
    "skewed",
    "table",
    "tail",
    "warnings",
    "write_csv",
    "write_json",
]

FORMAT = "mpistrat-bench/1"
# Below this many samples the 99th percentile is the maximum or an interpolation past it: not reported.
P99_MIN_ITERS = 100
# Metadata repeated on every CSV row, so files from several runs concatenate into one table.
CSV_META = (
    "label",
    "date",
    "ranks",
    "nodes",
    "scaling",
    "shard",
    "check",
    "mpistrat",
    "mpi4py",
    "mpi_library",
    "slurm_job_id",
    "partial",
)


_COLUMNS = (
    ("size", 9),
    ("count", 10),
    ("iters", 6),
    ("time", 10),
    ("min", 9),
    ("max", 9),
    ("p50", 9),
    ("p99", 9),
    ("algbw", 7),
    ("busbw", 7),
    ("raw", 10),
    ("ratio", 6),
)


def human(nbytes: int) -> str:
    """``nbytes`` with a binary unit, exact when it is a power of 1024 multiple."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def percentile(values: Sequence[float], p: float) -> float:
    """The nearest-rank ``p``-th percentile: the smallest value at least ``p`` % of ``values`` do not exceed.

    >>> percentile([5, 1, 4, 2, 3], 50), percentile(range(1, 101), 99), percentile(range(1, 101), 100)
    (3, 99, 100)
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def tail(per_iteration: Sequence[float]) -> dict[str, float | None]:
    """``p50`` and ``p99`` of per-iteration times; ``p99`` is None below :data:`P99_MIN_ITERS` of them.

    >>> tail([3.0, 1.0, 2.0])
    {'p50': 2.0, 'p99': None}
    """
    values = [float(v) for v in per_iteration]
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99) if len(values) >= P99_MIN_ITERS else None,
    }


def _us(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.2f}"


def scaling_mode(meta: dict[str, Any]) -> str:
    """How a run's times compare across rank counts: ``strong``, ``weak``, or ``sweep`` for a run
    without ``--scaling`` (computed as weak: each rank's message size was fixed). Files of earlier
    versions recorded ``weak`` for every run.

    >>> scaling_mode({"scaling": None}), scaling_mode({"scaling": "strong"})
    ('sweep', 'strong')
    """
    return meta.get("scaling") or "sweep"


def mode_title(mode: str) -> str:
    """A scaling mode in words: ``strong scaling``, ``weak scaling``, or a sweep's."""
    return "sweeps (no --scaling; computed as weak scaling)" if mode == "sweep" else f"{mode} scaling"


OVERSUBSCRIBED = (
    "oversubscribed: the ranks took turns on the cores, so the times measure that sharing, not mpistrat"
)
THREADS_UNSET = (
    "no thread variable was set (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, ...) and ranks shared a host: "
    "each rank's BLAS may start a thread per core, and the optimizer steps' norms then wait for cores "
    "the other ranks hold; a job with a rank per core sets one thread per rank (jobs/bench.sbatch does)"
)
SKEWED = "skewed"  # the mark of a row whose mean is more than SKEW times its median
SKEW = 2.0


def oversubscription(meta: dict[str, Any]) -> list[str]:
    """The hosts of a run where more ranks ran than the cores they may use, as bench says them.

    Files written before bench recorded it: one node and more ranks than rank 0's logical cores.
    """
    if "oversubscribed" in meta:
        return list(meta["oversubscribed"])
    cores = (meta.get("cpu") or {}).get("logical_cores")
    ranks, nodes = meta.get("ranks", 0), meta.get("nodes", 1)
    if nodes == 1 and cores and ranks > cores:
        host = (meta.get("hosts") or ["its host"])[0]
        return [f"{ranks} ranks on {cores} logical cores of {host}"]
    return []


def skewed(row: dict[str, Any]) -> list[str]:
    """The sides of ``row`` whose mean time exceeds :data:`SKEW` times their median (p50).

    >>> skewed({"mpistrat": {"time_us": {"avg": 1476.0, "p50": 320.0}}, "raw": {"time_us": {"avg": 9.0}}})
    ['mpistrat']
    """
    out = []
    for side in ("mpistrat", "raw", "raw2"):
        times = (row.get(side) or {}).get("time_us", {})
        if times.get("p50") and times["avg"] > SKEW * times["p50"]:
            out.append(side)
    return out


def warnings(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """What makes a run's times doubtful, in the words bench, report and plot share: cores shared
    by too many ranks, a busy host, rows whose mean is far above their median, a sweep that did
    not finish."""
    from mpistrat.tools import bench_load

    out = [f"{load}: {OVERSUBSCRIBED}" for load in oversubscription(meta)]
    out += bench_load.warnings(meta.get("load") or [])
    if _threads_unset(meta, rows):
        out.append(THREADS_UNSET)
    odd = [r for r in rows if skewed(r)]
    if odd:
        shown = "; ".join(
            f"{r['op']} {human(r['bytes'])}{'' if s == 'mpistrat' else f' ({s})'}: "
            f"mean {r[s]['time_us']['avg']:.2f} us, p50 {r[s]['time_us']['p50']:.2f}"
            for r in odd[:4]
            for s in skewed(r)[:1]
        )
        more = f" and {len(odd) - 4} more" if len(odd) > 4 else ""
        out.append(
            f"{len(odd)} row(s) marked {SKEWED!r} have a mean more than {SKEW:g}x their median (p50) "
            f"({shown}{more}): a few iterations took far longer than most, as when other processes take "
            "the cores; the p50 is the steadier figure"
        )
    if meta.get("partial"):
        out.append(f"partial results: {meta['partial']}")
    return out


def _threads_unset(meta: dict[str, Any], rows: list[dict[str, Any]]) -> bool:
    """Optimizer steps timed with several ranks on a host and no thread-count variable set (files
    written before bench recorded the variables: never)."""
    shared = meta.get("ranks", 1) > meta.get("nodes", 1)
    stepped = any(str(r.get("op", "")).startswith("apply_gradients") for r in rows)
    return shared and stepped and meta.get("threads") == {}


def head(meta: dict[str, Any]) -> list[str]:
    """The lines the table opens with (known before the sweep)."""
    hosts = ", ".join(meta["hosts"][:4]) + (", ..." if len(meta["hosts"]) > 4 else "")
    sharded = ", optimizer state sharded" if meta.get("shard") else ""  # absent from older files
    lines = [
        f"# mpistrat bench: {meta['ranks']} ranks on {meta['nodes']} node(s) ({hosts}), "
        f"check {'on' if meta['check'] else 'off'}{sharded}, {meta['date']}",
        f"# {meta['mpi_library'][:100]}",
        "# time: mean per iteration on each rank, in us, avg over ranks (min..max); "
        "p50/p99: percentiles of the slowest rank's time per iteration; "
        "algbw/busbw in GB/s (nccl-tests); ratio = mpistrat / raw",
    ]
    for load in meta.get("oversubscribed", ()):
        lines.append(f"# {load}: {OVERSUBSCRIBED} (rows marked 'oversubscribed')")
    return lines


def block_head(op_name: str, two: bool) -> list[str]:
    """The lines that open an operation's block of rows (``two``: it has a second raw form)."""
    from mpistrat.tools.bench_ops import OPS

    op = OPS[op_name]
    head = " ".join(f"{name:>{width}}" for name, width in _COLUMNS)
    return [
        "",
        f"## {op_name}: {op.mpistrat}  |  raw: {op.raw}" + (f"  |  raw2: {op.raw2}" if two else ""),
        head + (f" {'raw2':>10} {'ratio2':>6}" if two else "") + "  ok",
    ]


def row_line(r: dict[str, Any]) -> str:
    """One row of the table."""
    t = r["mpistrat"]["time_us"]
    line = (
        f"{human(r['bytes']):>9} {r['count']:>10} {r['iters']:>6} {t['avg']:>10.2f} {t['min']:>9.2f} "
        f"{t['max']:>9.2f} {_us(t.get('p50'), 9)} {_us(t.get('p99'), 9)} "
        f"{r['mpistrat']['algbw_GBps']:>7.3f} {r['mpistrat']['busbw_GBps']:>7.3f} "
        f"{r['raw']['time_us']['avg']:>10.2f} {r['ratio']:>6.2f}"
    )
    if r["raw2"] is not None:
        line += f" {r['raw2']['time_us']['avg']:>10.2f} {r['ratio2']:>6.2f}"
    sides = [s for s in ("mpistrat", "raw", "raw2") if r[s]]
    line += "  " + (
        "yes" if all(r[s]["ok"] for s in sides) else "NO: " + ",".join(s for s in sides if not r[s]["ok"])
    )
    marks = ["oversubscribed"] * bool(r.get("oversubscribed")) + [SKEWED] * bool(skewed(r))
    return line + "".join(f"  {m}" for m in marks)


def foot(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The lines the table closes with: what a '-' means, and the warnings."""
    lines = [""] if rows else []
    if any(r["mpistrat"]["time_us"].get("p99", 0) is None for r in rows):
        lines.append(
            f"# p99 '-': fewer than {P99_MIN_ITERS} timed iterations at that size, too few for a "
            "99th percentile (raise --iters / --min-iters)"
        )
    lines += [f"# WARNING: {w}" for w in warnings({**meta, "oversubscribed": []}, rows)]
    return lines


def table(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The results as text: the head, one block per operation, the notes (what bench prints row by row)."""
    lines = head(meta)
    for i, r in enumerate(rows):
        if i == 0 or r["op"] != rows[i - 1]["op"]:
            lines += block_head(r["op"], r["raw2"] is not None)
        lines.append(row_line(r))
    return "\n".join(lines + foot(meta, rows))


def _parent(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)


def _replace(path: str, write: Callable[[TextIO], None]) -> None:
    """Write ``path`` whole under a temporary name, then rename it into place: a job cut at any
    moment leaves the previous version or the new one, never a part of one."""
    _parent(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", newline="") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json(path: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    def write(f: TextIO) -> None:
        json.dump({"format": FORMAT, "meta": meta, "results": rows}, f, indent=1)
        f.write("\n")

    _replace(path, write)


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: row[k] for k in ("op", "bytes", "count", "leaves", "dtype", "ranks", "iters", "warmup")}
    for side in ("mpistrat", "raw", "raw2"):
        values = row[side] or {"time_us": {}, "ok": ""}
        prefix = "" if side == "mpistrat" else side + "_"
        for stat in ("min", "avg", "max", "p50", "p99"):
            value = values["time_us"].get(stat)
            out[f"{prefix}time_{stat}_us"] = "" if value is None else value
        out[f"{prefix}algbw_GBps"] = values.get("algbw_GBps", "")
        out[f"{prefix}busbw_GBps"] = values.get("busbw_GBps", "")
        out[f"{prefix}ok"] = values["ok"]
    out["ratio"] = row["ratio"]
    out["ratio2"] = "" if row["ratio2"] is None else row["ratio2"]
    out["oversubscribed"] = bool(row.get("oversubscribed"))
    out[SKEWED] = bool(skewed(row))
    return out


def write_csv(path: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    flat = [{**_flat(r), **{k: meta.get(k) for k in CSV_META}} for r in rows]

    def write(f: TextIO) -> None:
        writer = csv.DictWriter(f, fieldnames=list(flat[0]) if flat else ["op"])
        writer.writeheader()
        writer.writerows(flat)

    _replace(path, write)


def load(path: str) -> dict[str, Any]:
    """A results file written by ``--json``; refuses anything else with the reason."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidArgumentError(f"{path}: cannot read benchmark results ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InvalidArgumentError(
            f"{path}: not a results file of mpistrat bench (expected format {FORMAT!r}); "
            "write one with `mpistrat bench --json PATH`"
        )
    if not isinstance(data.get("meta"), dict) or not isinstance(data.get("results"), list):
        raise InvalidArgumentError(f"{path}: a results file needs a 'meta' object and a 'results' list")
    return data
