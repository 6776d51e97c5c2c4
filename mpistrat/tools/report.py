"""``mpistrat report``: tables from ``mpistrat bench --json`` files, a scaling table, a regression gate.

    mpistrat report results/bench-2.json                          # the rows of one run
    mpistrat report results/*/bench.json --csv efficiency.csv     # a series: + speed-up, efficiency
    mpistrat report new.json --reference old.json --tolerance 0.10   # exit 1 if a row got slower

It prints, for every file, each row's operation, size, ranks, dtype, time (mean, p50, p99),
ratio to raw mpi4py and bus bandwidth. Given files at several rank counts, it also prints the
scaling table of one operation at one size (``train_step`` when every file has it, else the
first operation they share; the largest size they share; ``--op``/``--size`` choose): ranks,
time, speed-up and parallel efficiency relative to the smallest rank count ``n0``, strong or
weak as the files' ``meta.scaling`` says (strong: speed-up ``T0/Tn``, efficiency
``T0·n0/(n·Tn)``; weak: efficiency ``T0/Tn``, speed-up ``efficiency·n/n0``), next to the same
for raw mpi4py, and the start of the job: seconds from process start to the first collective
of its slowest rank (``meta.startup``, ``mpistrat info --startup``'s points).

``--reference REF.json`` runs the regression gate (:mod:`mpistrat.tools.report_gate`): exit 1
when a row matching on (op, size, ranks, dtype) got slower than ``--tolerance`` allows, or when
no row matched; exit 2 when a time or the tolerance cannot be compared.

A run with more ranks on a host than the cores they may use (``meta.oversubscribed``, or for
an older file: one node, more ranks than rank 0's logical cores) is flagged: its rank count is
marked ``*`` in both tables, with a note saying so, because its times measure the sharing of
the cores rather than the library (:mod:`mpistrat.tools.host`).

>>> scaling_rows("strong", {1: [8.0], 2: [5.0], 4: [2.5]})
[(1, 1, 8.0, 1.0, 1.0), (2, 1, 5.0, 1.6, 0.8), (4, 1, 2.5, 3.2, 0.8)]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
from typing import Any, TextIO

from mpistrat.errors import InvalidArgumentError
from mpistrat.tools import report_gate
from mpistrat.tools.bench_report import (
    OVERSUBSCRIBED,
    human,
    load,
    mode_title,
    oversubscription,
    scaling_mode,
    skewed,
    warnings,
)
from mpistrat.tools.plot import speedup_efficiency
from mpistrat.tools.sizes import parse_size

__all__ = ["main", "result_rows", "scaling_rows", "scaling_table"]
ROW_COLUMNS = (
    "file",
    "op",
    "bytes",
    "size",
    "ranks",
    "dtype",
    "mean_us",
    "p50_us",
    "p99_us",
    "ratio",
    "busbw_GBps",
    "oversubscribed",
    "skewed",
)
SCALING_COLUMNS = (
    "mode",
    "op",
    "bytes",
    "size",
    "ranks",
    "runs",
    "time_us",
    "speedup",
    "efficiency",
    "raw_time_us",
    "raw_speedup",
    "raw_efficiency",
    "startup_s",
    "oversubscribed",
)


def startup_seconds(meta: dict[str, Any]) -> float | None:
    """The slowest rank's start, process start to first collective, of a run (None: not recorded)."""
    point = meta.get("startup", {}).get("summary", {}).get("first collective")
    return None if point is None else float(point["slowest"])


def result_rows(runs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One flat record per row of every file: what the rows table shows."""
    out = []
    for path, run in runs:
        crowded = bool(oversubscription(run["meta"]))
        for r in run["results"]:
            t = r["mpistrat"]["time_us"]
            out.append(
                {
                    "file": path,
                    "op": r["op"],
                    "bytes": r["bytes"],
                    "size": human(r["bytes"]),
                    "ranks": r["ranks"],
                    "dtype": r["dtype"],
                    "mean_us": t["avg"],
                    "p50_us": t.get("p50"),  # absent from files written before percentiles
                    "p99_us": t.get("p99"),
                    "ratio": r["ratio"],
                    "busbw_GBps": r["mpistrat"]["busbw_GBps"],
                    "oversubscribed": crowded,
                    "skewed": bool(skewed(r)),
                }
            )
    return out


def scaling_rows(mode: str, times: dict[int, list[float]]) -> list[tuple[int, int, float, float, float]]:
    """(ranks, runs, mean time, speed-up, efficiency) per rank count, relative to the smallest.

    ``times`` maps a rank count to the times of its runs; repeated runs count as their mean.
    """
    ranks = sorted(times)
    means = [sum(times[n]) / len(times[n]) for n in ranks]
    speedup, efficiency = speedup_efficiency(mode, ranks, means)
    return [(n, len(times[n]), t, s, e) for n, t, s, e in zip(ranks, means, speedup, efficiency, strict=True)]


def _common_choice(runs: list[dict[str, Any]], op: str | None, size: int | None) -> tuple[str, int]:
    """The operation and size of the scaling table, by the rule of ``mpistrat plot --kind scaling``."""
    per_run = [{r["op"] for r in run["results"]} for run in runs]
    common = [
        o
        for o in dict.fromkeys(r["op"] for run in runs for r in run["results"])
        if all(o in s for s in per_run)
    ]
    if op is None:
        if not common:
            raise InvalidArgumentError("no operation is in every results file; pass --op")
        op = "train_step" if "train_step" in common else common[0]
    elif op not in common:
        raise InvalidArgumentError(f"--op: {op!r} is not in every results file; common operations: {common}")
    sizes = sorted(set.intersection(*({r["bytes"] for r in run["results"] if r["op"] == op} for run in runs)))
    if size is None:
        if not sizes:
            raise InvalidArgumentError(f"{op}: no message size is in every results file; pass --size")
        size = sizes[-1]
    elif size not in sizes:
        raise InvalidArgumentError(
            f"--size: {op} at {human(size)} is not in every results file; sizes in all: "
            + ", ".join(human(s) for s in sizes)
        )
    return op, size


def scaling_table(
    runs: list[dict[str, Any]], op: str | None = None, size: int | None = None
) -> list[dict[str, Any]]:
    """One record per scaling mode and rank count: mpistrat's and raw's time, speed-up, efficiency."""
    op, size = _common_choice(runs, op, size)
    out = []
    modes = dict.fromkeys(scaling_mode(run["meta"]) for run in runs)
    for mode in sorted(modes):
        sides: dict[str, dict[int, list[float]]] = {"mpistrat": {}, "raw": {}}
        crowded: set[int] = set()  # rank counts with an oversubscribed run
        starts: dict[int, list[float]] = {}  # the slowest rank's start of each run
        for run in runs:
            if scaling_mode(run["meta"]) != mode:
                continue
            row = next(r for r in run["results"] if r["op"] == op and r["bytes"] == size)
            for side, times in sides.items():
                times.setdefault(int(row["ranks"]), []).append(row[side]["time_us"]["avg"])
            if oversubscription(run["meta"]):
                crowded.add(int(row["ranks"]))
            if (seconds := startup_seconds(run["meta"])) is not None:
                starts.setdefault(int(row["ranks"]), []).append(seconds)
        ours, raw = scaling_rows(mode, sides["mpistrat"]), scaling_rows(mode, sides["raw"])
        for (n, count, t, s, e), (_, _, rt, rs, re) in zip(ours, raw, strict=True):
            out.append(
                {
                    "mode": mode,
                    "op": op,
                    "bytes": size,
                    "size": human(size),
                    "ranks": n,
                    "runs": count,
                    "time_us": t,
                    "speedup": s,
                    "efficiency": e,
                    "raw_time_us": rt,
                    "raw_speedup": rs,
                    "raw_efficiency": re,
                    "startup_s": sum(starts[n]) / len(starts[n]) if n in starts else None,
                    "oversubscribed": n in crowded,
                }
            )
    return out


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


_ROW_HEAD = ("op", "size", "ranks", "dtype", "mean us", "p50 us", "p99 us", "ratio", "busbw GB/s")
_SCALING_HEAD = (
    "ranks",
    "runs",
    "time us",
    "speed-up",
    "efficiency",
    "raw us",
    "raw speed-up",
    "raw efficiency",
    "startup s",
)


def _ranks(r: dict[str, Any]) -> str:
    return f"{r['ranks']}*" if r["oversubscribed"] else str(r["ranks"])


def _row_cells(r: dict[str, Any]) -> list[str]:
    return [
        r["op"],
        r["size"],
        _ranks(r),
        r["dtype"],
        _fmt(r["mean_us"]),
        _fmt(r["p50_us"]),
        _fmt(r["p99_us"]),
        _fmt(r["ratio"]),
        _fmt(r["busbw_GBps"], ".3f"),
    ]


def _scaling_cells(r: dict[str, Any]) -> list[str]:
    return [
        _ranks(r),
        str(r["runs"]),
        _fmt(r["time_us"]),
        _fmt(r["speedup"]),
        _fmt(r["efficiency"]),
        _fmt(r["raw_time_us"]),
        _fmt(r["raw_speedup"]),
        _fmt(r["raw_efficiency"]),
        _fmt(r["startup_s"]),
    ]


def _text(head: tuple[str, ...], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        numeric = [all(_numeric(row[i]) for row in rows) for i in range(len(head))]
        return [
            "| " + " | ".join(head) + " |",
            "| " + " | ".join("---:" if n else "---" for n in numeric) + " |",
            *("| " + " | ".join(row) + " |" for row in rows),
        ]
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i < 1 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )
    return [line(head), *(line(row) for row in rows)]


def _numeric(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return cell == "-"
    return True


def _scaling_title(rows: list[dict[str, Any]], mode: str) -> str:
    first = next(r for r in rows if r["mode"] == mode)
    n0 = first["ranks"]
    formula = (
        "speed-up T0/Tn, efficiency T0*n0/(n*Tn)"
        if mode == "strong"
        else "efficiency T0/Tn, speed-up efficiency*n/n0"
    )
    ranks = f"{n0} rank{'s' if n0 != 1 else ''}"
    return f"{mode_title(mode)} of {first['op']} at {first['size']}, relative to {ranks} ({formula})"


_CROWDED = f"* {OVERSUBSCRIBED}: "
_P99 = "p99 '-': fewer timed iterations than a 99th percentile needs, or a file written before percentiles."


def render(
    runs: list[tuple[str, dict[str, Any]]], scaling: list[dict[str, Any]] | None, markdown: bool
) -> str:
    """Both tables as text or Markdown: the scaling table first when there is one, then each file's rows."""
    h = "## " if markdown else "# "
    lines: list[str] = []
    if scaling:
        for mode in dict.fromkeys(r["mode"] for r in scaling):
            lines += [h + _scaling_title(scaling, mode), ""]
            lines += _text(_SCALING_HEAD, [_scaling_cells(r) for r in scaling if r["mode"] == mode], markdown)
            lines.append("")
        crowded = [load for _, run in runs for load in oversubscription(run["meta"])]
        if crowded:
            lines += [_CROWDED + "; ".join(dict.fromkeys(crowded)), ""]
    without_p99 = False
    for path, run in runs:
        meta = run["meta"]
        n = meta["ranks"]
        about = f"{n} rank{'s' if n != 1 else ''}, {mode_title(scaling_mode(meta))}, {meta.get('date', '?')}"
        label = f" {meta['label']!r}" if meta.get("label") else ""
        lines += [h + f"{path}{label}: {about}", ""]
        if crowded := oversubscription(meta):
            lines += [_CROWDED + "; ".join(crowded), ""]
        if said := warnings({**meta, "oversubscribed": []}, run["results"]):
            lines += [*(f"WARNING: {w}" for w in said), ""]
        rows = result_rows([(path, run)])
        if not rows:
            lines += ["(no rows: the file's results list is empty)", ""]
            continue
        lines += _text(_ROW_HEAD, [_row_cells(r) for r in rows], markdown)
        lines.append("")
        without_p99 = without_p99 or any(r["p99_us"] is None for r in rows)
    if without_p99:
        lines.append(_P99)
    return "\n".join(lines).rstrip() + "\n"


def _open(path: str) -> contextlib.AbstractContextManager[TextIO]:
    """``path`` opened to write, its folder made; ``-``: standard output (left open)."""
    if path == "-":
        return contextlib.nullcontext(sys.stdout)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return open(path, "w", newline="")


def write_csv(path: str, records: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    with _open(path) as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        for r in records:
            writer.writerow({c: "" if r[c] is None else r[c] for c in columns})


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpistrat report",
        description="Tables of mpistrat bench results (JSON files): each row, the scaling of a series, "
        "and a regression gate against a reference run.",
    )
    p.add_argument("results", nargs="+", help="files written by `mpistrat bench --json`")
    p.add_argument(
        "--table",
        choices=("auto", "rows", "scaling"),
        default="auto",
        help="what --csv writes: every row, or the scaling table (auto: scaling when the files "
        "cover several rank counts, else rows)",
    )
    p.add_argument(
        "--op", default=None, help="scaling table: the operation (default train_step, else the first)"
    )
    p.add_argument(
        "--size", type=parse_size, default=None, help="scaling table: the size (default the largest)"
    )
    p.add_argument("--csv", metavar="PATH", help="write the table --table names as CSV ('-': to stdout)")
    p.add_argument(
        "--markdown", metavar="PATH", help="write the printed tables as Markdown ('-': to stdout, instead)"
    )
    p.add_argument(
        "--reference",
        metavar="REF.json",
        action="append",
        help="fail (exit 1) if a row matching one of REF's on op, size, ranks and dtype is slower "
        "than it by more than --tolerance; repeatable",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.10,
        help="allowed slow-down over the reference (default 0.10: 10%%)",
    )
    p.add_argument(
        "--metric",
        choices=tuple(report_gate.METRICS),
        default="mean",
        help="the time the gate compares (default mean; p50 is steadier on a shared machine)",
    )
    p.add_argument("--quiet", action="store_true", help="print only the gate's verdict")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report_gate.checked_tolerance(args.tolerance)
        runs = [(path, load(path)) for path in args.results]
        many = len({run["meta"]["ranks"] for _, run in runs}) > 1
        want_scaling = args.table == "scaling" or (args.table == "auto" and many)
        scaling = (
            scaling_table([run for _, run in runs], args.op, args.size) if (many or want_scaling) else None
        )
        if not args.quiet and "-" not in (args.markdown, args.csv):  # "-": that one on stdout instead
            print(render(runs, scaling, markdown=False), end="")
        if args.markdown:
            with _open(args.markdown) as f:
                f.write(render(runs, scaling, markdown=True))
        if args.csv:
            if want_scaling:
                write_csv(args.csv, scaling or [], SCALING_COLUMNS)
            else:
                write_csv(args.csv, result_rows(runs), ROW_COLUMNS)
        if not args.reference:
            return 0
        references = [(path, load(path)) for path in args.reference]
        now, then = report_gate.times(runs, args.metric), report_gate.times(references, args.metric)
        verdict = report_gate.gate(now, then, args.tolerance)
    except InvalidArgumentError as exc:
        print(f"mpistrat report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"mpistrat report: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    taken = "-" in (args.markdown, args.csv)  # stdout holds a file: the verdict goes beside it
    print(
        report_gate.verdict(verdict, args.reference, args.metric, args.tolerance),
        file=sys.stderr if taken else None,
    )
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
