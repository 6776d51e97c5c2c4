"""``mpistrat bench``: every collective next to its raw mpi4py equivalent, over message sizes.

Run it under the launcher, on as many ranks as the study needs::

    mpiexec -n 4 mpistrat bench --max 16MiB --json results/bench-4.json
    srun --mpi=pmi2 -n 64 python -m mpistrat bench --ops all_reduce,all_reduce_nest

For each operation and size (powers of two from ``--min`` to ``--max``) both sides
run on the same buffers, alternating, after an untimed warm-up; each iteration is
timed alone between untimed barriers, as the OSU Micro-Benchmarks do. A rank's
result is its mean time; the report gives min/avg/max over ranks, the algorithm
and bus bandwidth of nccl-tests (``busbw = algbw * 2(n-1)/n`` for all-reduce,
``(n-1)/n`` for all-gather) and the ratio mpistrat/raw. Every result is checked.
Sizes are spelled as ``mpistrat.tools.sizes.parse_size`` reads them: ``4``, ``64KiB``, ``1MB``, ``1g``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import sys
from typing import Any

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.collectives import check_enabled
from mpistrat.comm.mpi import mpi_datatype
from mpistrat.errors import MpistratError
from mpistrat.tools import bench_report
from mpistrat.tools.bench_ops import DEFAULT_OPS, OPS, OPT_IN, Case, Setup
from mpistrat.tools.sizes import parse_size

__all__ = ["main", "parse_size", "iterations", "sizes_between"]

# Above this many bytes the iteration count shrinks in proportion to the size (OSU's "large").
LARGE = 8 << 10


def sizes_between(low: int, high: int) -> list[int]:
    """Powers of two from ``low`` (rounded up to one) to ``high``.

    >>> sizes_between(4, 40)
    [4, 8, 16, 32]
    """
    size = 1 << max(0, (low - 1).bit_length())
    out = []
    while size <= high:
        out.append(size)
        size *= 2
    return out


def iterations(nbytes: int, iters: int, min_iters: int, warmup: int | None = None) -> tuple[int, int]:
    """(timed iterations, warm-up iterations) for a message of ``nbytes``, OSU-like.

    ``iters`` up to 8 KiB, then fewer in proportion to the size, never below ``min_iters``;
    the warm-up is a fifth of that unless given.

    >>> iterations(64, 1000, 20), iterations(1 << 20, 1000, 20)
    ((1000, 200), (20, 4))
    """
    n = iters if nbytes <= LARGE else max(min_iters, iters * LARGE // nbytes)
    n = max(1, min(n, iters))
    return n, max(1, n // 5) if warmup is None else warmup


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpistrat bench",
        description="Time mpistrat collectives against raw mpi4py on the same buffers (under mpiexec/srun).",
    )
    p.add_argument(
        "--ops",
        default=",".join(DEFAULT_OPS),
        help=f"comma-separated, from {', '.join(OPS)} (default: all but {', '.join(OPT_IN)})",
    )
    p.add_argument("--min", type=parse_size, default=4, help="smallest message size (default 4)")
    p.add_argument("--max", type=parse_size, default=64 << 20, help="largest message size (default 64MiB)")
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument(
        "--leaves",
        type=int,
        default=64,
        help="leaves of the nest ops, variables of the optimizer ops (default 64)",
    )
    p.add_argument("--iters", type=int, default=1000, help="timed iterations up to 8KiB (default 1000)")
    p.add_argument("--min-iters", type=int, default=20, help="fewest timed iterations for large sizes")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default: iterations / 5)")
    p.add_argument("--no-check", action="store_true", help="turn off mpistrat's consistency handshake")
    p.add_argument(
        "--bytes-per-pack",
        type=parse_size,
        default=0,
        help="CommunicationOptions.bytes_per_pack (default 0: one pack)",
    )
    p.add_argument(
        "--scaling",
        choices=("strong", "weak"),
        default="weak",
        help="train_step: batch is global (strong) or per rank (weak)",
    )
    p.add_argument("--batch", type=int, default=256, help="train_step batch size (default 256)")
    p.add_argument(
        "--shard",
        action="store_true",
        help="apply_gradients ops: the mpistrat optimizer shards its state (shard_state=True)",
    )
    p.add_argument("--label", default=None, help="name of this run in tables and plots")
    p.add_argument("--json", metavar="PATH", help="write results and metadata as JSON")
    p.add_argument("--csv", metavar="PATH", help="write results as CSV (metadata in # comment lines)")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when stderr is a terminal)",
    )
    p.add_argument("--quiet", action="store_true", help="no table")
    return p


def _measure(comm: MPI.Intracomm, case: Case, iters: int, warmup: int) -> dict[str, tuple[float, bool]]:
    """This rank's mean time per variant, and whether every result checked out."""
    names = list(case.variants)
    totals = dict.fromkeys(names, 0.0)
    ok = dict.fromkeys(names, True)
    wtime = MPI.Wtime
    for i in range(warmup + iters):
        shift = i % len(names)  # alternate which side goes first
        for name in names[shift:] + names[:shift]:
            fn, check = case.variants[name]
            comm.Barrier()
            start = wtime()
            out = fn()
            elapsed = wtime() - start
            if i >= warmup:
                totals[name] += elapsed
            if ok[name] and not check(out):
                ok[name] = False
    return {name: (totals[name] / iters, ok[name]) for name in names}


def _over_ranks(comm: MPI.Intracomm, t: float) -> dict[str, float]:
    n = comm.Get_size()
    return {
        "min": comm.allreduce(t, op=MPI.MIN) * 1e6,
        "avg": comm.allreduce(t, op=MPI.SUM) / n * 1e6,
        "max": comm.allreduce(t, op=MPI.MAX) * 1e6,
    }


def _run_case(
    strategy: mpistrat.MPIStrategy, op_name: str, setup: Setup, args: Any, seen: set[tuple[str, int]]
) -> tuple[Case, dict[str, Any] | None]:
    """The case and its timings; no timings when ``seen`` holds its size already."""
    op = OPS[op_name]

    def body() -> tuple[Case, dict[str, Any] | None]:
        case = op.build(setup)
        if (op_name, case.nbytes) in seen:  # every rank builds the same size, so every rank skips
            return case, None
        iters, warmup = iterations(case.nbytes, args.iters, args.min_iters, args.warmup)
        return case, {"iters": iters, "warmup": warmup, **_measure(setup.comm, case, iters, warmup)}

    if op.context == "replica":
        return strategy.run(body)
    if op.context == "cross_replica":
        with strategy.scope():
            return body()
    return body()


def _record(comm: MPI.Intracomm, op_name: str, case: Case, timed: dict, args: Any) -> dict[str, Any]:
    op, n = OPS[op_name], comm.Get_size()
    factor = op.busbw(n)

    def side(name: str) -> dict[str, Any]:
        t, ok = timed[name]
        times = _over_ranks(comm, t)
        algbw = case.nbytes / (times["avg"] * 1e-6) / 1e9 if times["avg"] > 0 else 0.0
        return {
            "time_us": times,
            "algbw_GBps": algbw,
            "busbw_GBps": algbw * factor,
            "ok": bool(comm.allreduce(ok, op=MPI.LAND)),
        }

    row: dict[str, Any] = {
        "op": op_name,
        "bytes": case.nbytes,
        "count": case.count,
        "leaves": case.leaves,
        "dtype": args.dtype,
        "ranks": n,
        "iters": timed["iters"],
        "warmup": timed["warmup"],
        "mpistrat": side("mpistrat"),
        "raw": side("raw"),
        "raw2": side("raw2") if "raw2" in timed else None,
    }
    row["ratio"] = row["mpistrat"]["time_us"]["avg"] / row["raw"]["time_us"]["avg"]
    row["ratio2"] = row["mpistrat"]["time_us"]["avg"] / row["raw2"]["time_us"]["avg"] if row["raw2"] else None
    return row


def _metadata(
    comm: MPI.Intracomm, strategy: mpistrat.MPIStrategy, args: Any, argv: list[str]
) -> dict[str, Any]:
    import mpi4py

    hosts = comm.allgather(MPI.Get_processor_name() or socket.gethostname())
    n = comm.Get_size()
    options = {k: v for k, v in vars(args).items() if k not in ("json", "csv", "progress", "quiet")}
    return {
        "format": bench_report.FORMAT,
        "label": args.label or f"{n} rank{'s' if n > 1 else ''}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ranks": n,
        "nodes": len(set(hosts)),
        "hosts": sorted(set(hosts)),
        "scaling": args.scaling,
        "shard": args.shard,
        "check": check_enabled(strategy.extended.collectives),
        "mpistrat": mpistrat.__version__,
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "mpi_library": " ".join(MPI.Get_library_version().split()),
        "mpi_version": "{}.{}".format(*MPI.Get_version()),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "command": ["mpistrat", "bench", *argv],
        "options": options,
    }


def _validate(args: Any, parser: argparse.ArgumentParser) -> list[str]:
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        parser.error(f"--ops: unknown {unknown or 'empty list'}; choose from {', '.join(OPS)}")
    try:
        args.dtype = np.dtype(args.dtype).name
        mpi_datatype(np.dtype(args.dtype))
        if np.dtype(args.dtype).kind not in "iufc":
            raise TypeError(args.dtype)
    except (TypeError, MpistratError):
        parser.error(
            f"--dtype: expected a numeric dtype MPI can reduce (float32, int64, ...); got {args.dtype!r}"
        )
    for name in ("leaves", "iters", "min_iters", "batch"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')}: expected a positive integer; got {getattr(args, name)}"
            )
    if args.min > args.max:
        parser.error(f"--min ({args.min}) is larger than --max ({args.max})")
    return ops


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    ops = _validate(args, parser)
    world = MPI.COMM_WORLD
    comm = world.Dup()
    options = mpistrat.CommunicationOptions(
        bytes_per_pack=args.bytes_per_pack, check=False if args.no_check else None
    )
    strategy = mpistrat.MPIStrategy(world, communication_options=options)
    rank = comm.Get_rank()
    meta = _metadata(comm, strategy, args, argv)
    tasks = [(o, s) for o in ops for s in sizes_between(args.min, args.max)]
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    bar = _progress(len(tasks), rank == 0 and show)
    rows: list[dict[str, Any]] = []
    seen: set[tuple[str, int]] = set()
    for op_name, nbytes in tasks:
        bar.set_postfix_str(f"{op_name} {bench_report.human(nbytes)}", refresh=False)
        setup = Setup(
            strategy, comm, np.dtype(args.dtype), nbytes, args.leaves, args.batch, args.scaling, args.shard
        )
        # sizes below an op's smallest message (nest ops: one element per leaf) repeat it: time it once
        case, timed = _run_case(strategy, op_name, setup, args, seen)
        bar.update(1)
        if timed is None:
            continue
        seen.add((op_name, case.nbytes))
        rows.append(_record(comm, op_name, case, timed, args))
    bar.close()
    failed = [
        f"{r['op']} {r['bytes']} B ({side})"
        for r in rows
        for side in ("mpistrat", "raw", "raw2")
        if r[side] and not r[side]["ok"]
    ]
    if rank == 0:
        if not args.quiet:
            print(bench_report.table(meta, rows), flush=True)
        if args.json:
            bench_report.write_json(args.json, meta, rows)
        if args.csv:
            bench_report.write_csv(args.csv, meta, rows)
        if failed:
            print("mpistrat bench: WRONG RESULTS for " + ", ".join(failed), file=sys.stderr, flush=True)
    strategy.experimental_finalize()
    comm.Free()
    return 1 if failed else 0


class _NoBar:
    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, show: bool) -> Any:
    if not show:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="mpistrat bench", unit="size", file=sys.stderr, dynamic_ncols=True)


if __name__ == "__main__":
    sys.exit(main())
