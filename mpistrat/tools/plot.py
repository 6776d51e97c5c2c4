"""``mpistrat plot``: figures from ``mpistrat bench --json`` results (needs matplotlib).

``mpistrat plot RESULTS... -o FILE.png`` draws, per operation:

- ``--kind bandwidth``: bus bandwidth versus message size, mpistrat solid, raw mpi4py
  dashed (and a second raw reference dotted), one colour per results file;
- ``--kind ratio``: mpistrat time / raw time versus size (1 is no overhead);
- ``--kind scaling``: for one operation and size, time, speed-up and parallel
  efficiency versus ranks, one row per scaling mode found in the files (``strong``:
  fixed global work, ideal speed-up ``n/n0``; ``weak``: fixed work per rank, ideal
  efficiency 1), relative to the smallest rank count ``n0``.

- ``--kind heatmap``: from a timeline (``mpistrat timeline``'s trace, or its
  ``MPISTRAT_TIMELINE`` directory), a rank x time heat map of the wait each rank imposed.

``auto`` (the default) is ``heatmap`` for a timeline, ``scaling`` when the files cover
several rank counts, else ``bandwidth``.

>>> speedup_efficiency("strong", [1, 2, 4], [8.0, 4.0, 4.0])
([1.0, 2.0, 2.0], [1.0, 1.0, 0.5])
>>> speedup_efficiency("weak", [1, 2], [5.0, 10.0])
([1.0, 1.0], [1.0, 0.5])
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from mpistrat.errors import InvalidArgumentError
from mpistrat.tools import heatmap
from mpistrat.tools.bench_report import (
    OVERSUBSCRIBED,
    human,
    load,
    mode_title,
    oversubscription,
    scaling_mode,
)
from mpistrat.tools.sizes import parse_size

__all__ = ["main", "speedup_efficiency"]

_STYLES = {"mpistrat": "-", "raw": "--", "raw2": ":"}


def speedup_efficiency(mode: str, ranks: list[int], times: list[float]) -> tuple[list[float], list[float]]:
    """Speed-up and parallel efficiency relative to the first (smallest) rank count.

    Strong scaling (same total work): speed-up ``T0/T``, efficiency ``speed-up * n0/n``.
    Weak scaling (same work per rank): speed-up ``(n/n0) * T0/T``, efficiency ``T0/T``.
    """
    n0, t0 = ranks[0], times[0]
    if mode == "strong":
        speedup = [t0 / t for t in times]
        return speedup, [s * n0 / n for s, n in zip(speedup, ranks, strict=True)]
    efficiency = [t0 / t for t in times]
    return [e * n / n0 for e, n in zip(efficiency, ranks, strict=True)], efficiency


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpistrat plot", description="Plot mpistrat bench results (JSON files).")
    p.add_argument("results", nargs="+", help="files of `mpistrat bench --json`, or one timeline")
    p.add_argument("-o", "--output", required=True, help="image to write (.png, .svg, .pdf)")
    p.add_argument(
        "--kind",
        choices=("auto", "bandwidth", "ratio", "scaling", "heatmap"),
        default="auto",
        help="bandwidth: bus bandwidth vs size; ratio: mpistrat/raw time vs size; scaling: time, "
        "speed-up and efficiency vs ranks; heatmap: a timeline's imposed wait. auto (default): "
        "heatmap for a timeline, scaling when the files cover several rank counts, else bandwidth",
    )
    p.add_argument("--bins", type=int, default=None, help="heatmap: time bins (default: up to 100)")
    p.add_argument("--ops", default=None, help="comma-separated operations to draw (default: all found)")
    p.add_argument("--metric", choices=("busbw", "algbw", "time"), default="busbw", help="bandwidth plot's y")
    p.add_argument("--op", default=None, help="scaling: the operation (default train_step, else the first)")
    p.add_argument(
        "--size", type=parse_size, default=None, help="scaling: message size (default the largest)"
    )
    p.add_argument("--title", default=None)
    return p


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise InvalidArgumentError(
            "mpistrat plot needs matplotlib: pip install matplotlib (or pip install '.[plot]' in the clone)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _size_axis(ax: Any) -> None:
    import matplotlib.ticker as ticker

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(ticker.LogLocator(base=4))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: human(int(x)).replace(" ", "")))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("message size")
    ax.grid(True, which="major", alpha=0.3)


def _ops(runs: list[dict[str, Any]], wanted: str | None) -> list[str]:
    found = list(dict.fromkeys(r["op"] for run in runs for r in run["results"]))
    if wanted is None:
        return found
    ops = [o.strip() for o in wanted.split(",") if o.strip()]
    missing = [o for o in ops if o not in found]
    if missing:
        raise InvalidArgumentError(f"--ops: {missing} not in the results; they hold {found}")
    return ops


def _grid(plt: Any, n: int) -> tuple[Any, list[Any]]:
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows + 0.8), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


# What each line style stands for: a side's own figure, or on the ratio figure mpistrat over that side.
_SIDES = {"mpistrat": "mpistrat", "raw": "raw mpi4py", "raw2": "raw, second form (fused call; flat step)"}
_RATIOS = {"raw": "mpistrat / raw mpi4py", "raw2": "mpistrat / raw, second form (fused call; flat step)"}


def _label(run: dict[str, Any]) -> str:
    """A run's name in a legend: its label, ``*`` when oversubscribed, ``(partial)`` when cut short."""
    meta = run["meta"]
    return meta["label"] + " *" * bool(oversubscription(meta)) + " (partial)" * bool(meta.get("partial"))


def _footnote(fig: Any, runs: list[dict[str, Any]]) -> bool:
    """The note under a figure with oversubscribed points, in report's words; whether there is one."""
    crowded = list(dict.fromkeys(load for run in runs for load in oversubscription(run["meta"])))
    if crowded:
        fig.text(0.01, 0.01, f"* {OVERSUBSCRIBED}: {'; '.join(crowded)}", fontsize=8, ha="left", va="bottom")
    return bool(crowded)


def _legend(fig: Any, runs: list[dict[str, Any]], sides: list[str], colours: list[Any], kind: str) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, lw=2, label=_label(run)) for run, c in zip(runs, colours, strict=True)]
    names = _RATIOS if kind == "ratio" else _SIDES
    handles += [Line2D([], [], color="0.3", ls=_STYLES[s], label=names[s]) for s in sides]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 6), frameon=False)


def _per_size(plt: Any, runs: list[dict[str, Any]], ops: list[str], kind: str, metric: str) -> Any:
    import matplotlib.ticker as ticker

    from mpistrat.tools.bench_ops import OPS

    fig, axes = _grid(plt, len(ops))
    colours = [plt.get_cmap("tab10")(i % 10) for i in range(len(runs))]
    sides_used: set[str] = set()
    for ax, op in zip(axes, ops, strict=True):
        for run, colour in zip(runs, colours, strict=True):
            rows = sorted((r for r in run["results"] if r["op"] == op), key=lambda r: r["bytes"])
            if not rows:
                continue
            x = [r["bytes"] for r in rows]
            for side in ("mpistrat", "raw", "raw2"):
                if not rows[0][side]:
                    continue
                if kind == "ratio":
                    if side == "mpistrat":
                        continue
                    y = [r["ratio" if side == "raw" else "ratio2"] for r in rows]
                else:
                    y = [_metric(r, side, metric) for r in rows]
                sides_used.add(side)
                ax.plot(x, y, _STYLES[side], color=colour, marker="o", ms=3, lw=1.5)
        _size_axis(ax)
        title = f"{op}: {OPS[op].mpistrat}" if op in OPS else op
        ax.set_title(title, fontsize=9)
        if kind == "ratio":
            ax.axhline(1.0, color="0.5", lw=0.8)
            ax.set_yscale("log", base=2)  # 0.25 and 4 are as far from parity
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
            ax.set_ylabel("time mpistrat / raw")
        else:
            ax.set_yscale("log")
            ax.set_ylabel(
                {"busbw": "bus bandwidth (GB/s)", "algbw": "algorithm bandwidth (GB/s)"}.get(
                    metric, "time (us)"
                )
            )
    sides = [s for s in _STYLES if s in sides_used]
    if kind == "ratio":
        sides = [s for s in sides if s != "mpistrat"]
    _legend(fig, runs, sides, colours, kind)
    _footnote(fig, runs)
    return fig


def _metric(row: dict[str, Any], side: str, metric: str) -> float:
    if metric == "time":
        return row[side]["time_us"]["avg"]
    if metric == "busbw" and row["ranks"] == 1:  # no bus traffic at one rank: show algbw
        return row[side]["algbw_GBps"]
    return row[side][f"{metric}_GBps"]


def _scaling(plt: Any, runs: list[dict[str, Any]], op: str | None, size: int | None) -> Any:
    ops = [o for o in _ops(runs, None) if all(any(r["op"] == o for r in run["results"]) for run in runs)]
    if op is None:
        op = "train_step" if "train_step" in ops else (ops[0] if ops else None)
    if op not in ops:
        raise InvalidArgumentError(f"--op: {op!r} is not in every results file; common operations: {ops}")
    sizes = [{r["bytes"] for r in run["results"] if r["op"] == op} for run in runs]
    common = sorted(set.intersection(*sizes))
    if size is None:
        if not common:
            raise InvalidArgumentError(f"{op}: no message size is in every results file; pass --size")
        size = common[-1]
    modes = sorted({scaling_mode(run["meta"]) for run in runs})
    fig, axes = plt.subplots(len(modes), 3, figsize=(15, 4.0 * len(modes) + 0.8), squeeze=False)
    for row_axes, mode in zip(axes, modes, strict=True):
        by_ranks: dict[int, dict[str, list[float]]] = {}
        crowded: set[int] = set()  # rank counts with an oversubscribed run, marked as report marks them
        for run in runs:
            if scaling_mode(run["meta"]) != mode:
                continue
            if oversubscription(run["meta"]):
                crowded.add(run["meta"]["ranks"])
            rows = [r for r in run["results"] if r["op"] == op and r["bytes"] == size]
            if not rows:
                raise InvalidArgumentError(
                    f"{run['meta']['label']}: no {op} result at {human(size)}; pass --size"
                )
            entry = by_ranks.setdefault(run["meta"]["ranks"], {"mpistrat": [], "raw": []})
            for side in entry:
                entry[side].append(rows[0][side]["time_us"]["avg"])
        ranks = sorted(by_ranks)
        # repeated runs at one rank count: their mean
        means = {
            side: [sum(by_ranks[n][side]) / len(by_ranks[n][side]) for n in ranks]
            for side in ("mpistrat", "raw")
        }
        unit, scale = ("ms", 1e-3) if max(means["mpistrat"] + means["raw"]) > 1e4 else ("us", 1.0)
        for side, times in means.items():
            speedup, efficiency = speedup_efficiency(mode, ranks, times)
            label = "mpistrat" if side == "mpistrat" else "raw mpi4py"
            for ax, y in zip(row_axes, ([t * scale for t in times], speedup, efficiency), strict=True):
                ax.plot(
                    ranks,
                    y,
                    _STYLES[side],
                    marker="o",
                    color="C0" if side == "mpistrat" else "C1",
                    label=label,
                )
                marked = [(n, v) for n, v in zip(ranks, y, strict=True) if n in crowded]
                if marked:  # a red ring around each oversubscribed point, one legend entry per axis
                    ax.plot(
                        *zip(*marked, strict=True),
                        ls="none",
                        marker="o",
                        ms=12,
                        mfc="none",
                        mec="red",
                        mew=1.5,
                        label="* oversubscribed" if side == "mpistrat" else None,
                    )
        ideal_speedup = [n / ranks[0] for n in ranks]
        row_axes[1].plot(ranks, ideal_speedup, color="0.6", lw=0.8, label="ideal")
        row_axes[2].plot(ranks, [1.0] * len(ranks), color="0.6", lw=0.8, label="ideal")
        titles = (f"time per call ({unit})", "speed-up", "parallel efficiency")
        for ax, title in zip(row_axes, titles, strict=True):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ranks, [f"{n}*" if n in crowded else str(n) for n in ranks])
            ax.set_xlabel("ranks")
            ax.set_title(f"{mode_title(mode)}: {title}", fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        row_axes[2].set_ylim(0, max(1.1, row_axes[2].get_ylim()[1]))
    fig.suptitle(f"{op} at {human(size)}", y=0.995)
    _footnote(fig, runs)
    return fig


# What matplotlib's Agg canvas writes, by file name extension.
FORMATS = (
    "png",
    "svg",
    "svgz",
    "pdf",
    "eps",
    "ps",
    "jpg",
    "jpeg",
    "tif",
    "tiff",
    "webp",
    "pgf",
    "raw",
    "rgba",
)


def _check_output(path: str) -> None:
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    if extension not in FORMATS:
        raise InvalidArgumentError(
            f"-o {path}: cannot draw a {'.' + extension if extension else 'file without an extension'}; "
            "name an image: .png, .svg or .pdf (or "
            + ", ".join("." + f for f in FORMATS if f not in ("png", "svg", "pdf"))
            + ")"
        )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        _check_output(args.output)
        if args.kind == "heatmap" or (args.kind == "auto" and heatmap.is_timeline(args.results[0])):
            return _heatmap(args)
        runs = [load(path) for path in args.results]
        plt = _pyplot()
        ops = _ops(runs, args.ops)
        kind = args.kind
        if kind == "auto":
            kind = "scaling" if len({run["meta"]["ranks"] for run in runs}) > 1 else "bandwidth"
        if kind == "scaling":
            fig = _scaling(plt, runs, args.op, args.size)
        else:
            fig = _per_size(plt, runs, ops, kind, args.metric)
    except InvalidArgumentError as exc:
        print(f"mpistrat plot: {exc}", file=sys.stderr)
        return 2
    if args.title:
        fig.suptitle(args.title)
    noted = any(oversubscription(run["meta"]) for run in runs)  # room for the footnote
    fig.tight_layout(rect=(0, 0.04 if noted else 0, 1, 0.93 if kind != "scaling" else 0.97))
    try:
        fig.savefig(args.output, dpi=110)
    except OSError as exc:
        print(f"mpistrat plot: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    finally:
        plt.close(fig)
    print(f"mpistrat plot: wrote {args.output} ({kind}, {len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0


def _heatmap(args: argparse.Namespace) -> int:
    if len(args.results) != 1:
        raise InvalidArgumentError(f"a heat map is of one timeline; got {len(args.results)} files")
    plt = _pyplot()
    trace = heatmap.read_trace(args.results[0])
    for note in trace.get("otherData", {}).get("notes", []):
        print(f"mpistrat plot: {note}", file=sys.stderr)
    fig = heatmap.draw(plt, trace, bins=args.bins and max(args.bins, 1))
    if args.title:
        fig.axes[0].set_title(args.title)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    plt.close(fig)
    print(f"mpistrat plot: wrote {args.output} (heatmap)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
