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

Each rank also keeps every iteration's time; one ``Allreduce(MAX)`` per row at the end
(never one per iteration) gives the slowest rank's time of each iteration, whose median
and 99th percentile are ``p50`` and ``p99`` (nearest rank). A p99 needs at least
``bench_report.P99_MIN_ITERS`` (100) timed iterations: with fewer it is ``null`` in the
JSON, empty in the CSV and ``-`` in the table, which says so.
Sizes are spelled as ``mpistrat.tools.sizes.parse_size`` reads them: ``4``, ``64KiB``, ``1MB``, ``1g``.

Rank 0 prints each row as it is measured and rewrites ``--json``/``--csv`` with every row so far
(:mod:`~mpistrat.tools.bench_report`), so a job cut at any moment keeps what it measured.
``SIGTERM`` or ``SIGUSR1`` on any rank ends the sweep on every rank after the size in progress
(one ``MAX`` per size agrees on it), the files marked partial, exit status :data:`STOPPED`. The
load on each host before and after is recorded and warned about (:mod:`~mpistrat.tools.bench_load`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import signal
import socket
import sys
import threading
import time
from typing import Any

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.collectives import Collectives, check_enabled
from mpistrat.tools import bench_args, bench_load, bench_meta, bench_report, host, startup_info
from mpistrat.tools import bench_progress as progress
from mpistrat.tools.bench_ops import OPS, Case, Setup
from mpistrat.tools.sizes import parse_size

__all__ = ["main", "parse_size", "iterations", "sizes_between"]

# Above this many bytes the iteration count shrinks in proportion to the size (OSU's "large").
LARGE = 8 << 10
# Slurm's time limit (SIGTERM) and its warning (--signal=USR1@...): the sweep ends after the current size.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOPPED = 75  # the exit status of a sweep a signal stopped (EX_TEMPFAIL, as a preempted training job's)


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


def _measure(comm: MPI.Intracomm, case: Case, iters: int, warmup: int) -> dict[str, tuple[np.ndarray, bool]]:
    """This rank's time of every timed iteration per variant (s), and whether every result checked out."""
    names = list(case.variants)
    times = {name: np.zeros(iters) for name in names}
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
                times[name][i - warmup] = elapsed
            if ok[name] and not check(out):
                ok[name] = False
            if case.settle is not None:
                case.settle()
    return {name: (times[name], ok[name]) for name in names}


def _over_ranks(comm: MPI.Intracomm, times: np.ndarray) -> dict[str, float | None]:
    """min/avg/max over ranks of each rank's mean, and p50/p99 of the slowest rank's time per iteration."""
    n = comm.Get_size()
    t = float(times.mean())
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)  # once per row, after the timed loop
    return {
        "min": comm.allreduce(t, op=MPI.MIN) * 1e6,
        "avg": comm.allreduce(t, op=MPI.SUM) / n * 1e6,
        "max": comm.allreduce(t, op=MPI.MAX) * 1e6,
        **bench_report.tail((slowest * 1e6).tolist()),
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
        per_iteration, ok = timed[name]
        times = _over_ranks(comm, per_iteration)
        mean = times["avg"] or 0.0
        algbw = case.nbytes / (mean * 1e-6) / 1e9 if mean > 0 else 0.0
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
    comm: MPI.Intracomm, collectives: Collectives, args: Any, argv: list[str], loads: list[host.HostLoad]
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
        "check": check_enabled(collectives),
        "mpistrat": mpistrat.__version__,
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "mpi_library": " ".join(MPI.Get_library_version().split()),
        "mpi_version": "{}.{}".format(*MPI.Get_version()),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "command": ["mpistrat", "bench", *argv],
        "options": options,
        "p99_min_iters": bench_report.P99_MIN_ITERS,
        "environment": bench_meta.environment(),
        "cpu": bench_meta.cpu(),
        "affinity": comm.allgather(bench_meta.affinity()),  # index: rank
        "git_commit": bench_meta.git_commit() if comm.Get_rank() == 0 else None,
        "host_load": [dataclasses.asdict(h) for h in loads],  # ranks and the cores they may use, per host
        "oversubscribed": [str(h) for h in loads if h.oversubscribed],
        "threads": host.threads(),
        "startup": startup_info.of_job(comm),  # each rank's start: MPI_Init, import, first collective
    }


def _before_the_sweep(
    world: MPI.Intracomm, args: Any, ops: list[str], sizes: list[int], loads: list[host.HostLoad]
) -> list[str]:
    """What keeps the sweep from starting, the same on every rank (collective): an output file or a
    checkpoint directory rank 0 cannot write, a largest size whose buffers would not fit in a host's
    memory."""
    mine = []
    if world.Get_rank() == 0:  # rank 0 writes the files, so rank 0 alone tries them
        mine = [
            f"--{flag} {path}: cannot write it ({why})"
            for flag, path in (("json", args.json), ("csv", args.csv))
            if (why := bench_args.unwritable(path))
        ]
        where = args.checkpoint_dir or os.getcwd()
        checkpoints = any(op.startswith("checkpoint") for op in ops)
        if checkpoints and (why := bench_args.unusable_directory(where)):
            mine.append(f"--checkpoint-dir {where}: cannot write checkpoints there ({why})")
    if sizes:
        here = next(h for h in loads if h.host == host.name())
        available = host.memory_available()
        if problem := bench_args.memory_problem(ops, sizes[-1], world.Get_size(), here, available):
            mine.append(problem)
    return list(dict.fromkeys(p for found in world.allgather(mine) for p in found))


def _oversubscribed(meta: dict[str, Any]) -> list[str]:
    return [
        f"WARNING: {load}: {bench_report.OVERSUBSCRIBED} (the rows are marked oversubscribed). "
        "Start at most one rank per core"
        for load in meta["oversubscribed"]
    ]


class _Signals:
    """SIGTERM and SIGUSR1 (Slurm's time limit and its warning) noted, not fatal, while the sweep
    runs: the ranks stop together after the row they are in (:meth:`agreed`)."""

    def __init__(self) -> None:
        self.seen = 0
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self._note)
        return self

    def _note(self, signum: int, frame: Any) -> None:
        self.seen = signum

    def agreed(self, comm: MPI.Intracomm) -> int:
        """The signal some rank saw, or 0 (collective: every rank stops after the same row)."""
        return int(comm.allreduce(self.seen, op=MPI.MAX))

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)


class _Outputs:
    """Rank 0's files: the JSON and the CSV, rewritten whole after every row."""

    def __init__(self, args: Any):
        self.paths = {
            flag: (path, write)
            for flag, path, write in (
                ("json", args.json, bench_report.write_json),
                ("csv", args.csv, bench_report.write_csv),
            )
            if path
        }
        self.failed = False

    def write(self, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        for flag, (path, write) in list(self.paths.items()):
            try:
                write(path, meta, rows)
            except OSError as exc:  # say so once and keep the other file
                print(
                    f"mpistrat bench: --{flag} {path}: could not write the results ({exc})", file=sys.stderr
                )
                del self.paths[flag]
                self.failed = True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = bench_args.parser()
    args = parser.parse_args(argv)
    ops = bench_args.validate(args, parser)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    sizes = sizes_between(args.min, args.max)
    loads = host.gather(world)
    problems = _before_the_sweep(world, args, ops, sizes, loads)
    if problems:
        if rank == 0:
            print("mpistrat bench: " + "; ".join(problems), file=sys.stderr, flush=True)
        return 2
    comm = world.Dup()
    options = mpistrat.CommunicationOptions(
        bytes_per_pack=args.bytes_per_pack,
        check=False if args.no_check else None,
        deterministic=True if args.deterministic else None,
        compression=args.compression,
    )
    rtol = bench_args.tolerance(args, world.Get_size())
    strategy = mpistrat.MPIStrategy(world, communication_options=options)
    collectives = strategy.extended.collectives  # taken once: the metadata reads its check level
    meta = _metadata(comm, collectives, args, argv, loads)
    if rank == 0:
        for note in bench_args.notes(args, sizes) + _oversubscribed(meta):
            print(f"mpistrat bench: {note}", file=sys.stderr, flush=True)
    tasks = [(o, s) for o in ops for s in sizes]
    outputs = _Outputs(args) if rank == 0 else None
    watch = bench_load.Watch(comm, loads)
    meta["load"] = watch.record()
    shown = progress.choose(args.progress, rank == 0, len(tasks), quiet=args.quiet)
    try:  # the bar closed before an interrupt is reported, so it does not redraw after the message
        rows = _sweep(strategy, comm, tasks, args, rtol, meta, outputs, shown)
    finally:
        shown.close()
    meta["load"] = watch.finish()
    failed = [
        f"{r['op']} {r['bytes']} B ({side})"
        for r in rows
        for side in ("mpistrat", "raw", "raw2")
        if r[side] and not r[side]["ok"]
    ]
    code = 1 if failed else STOPPED if meta["partial"] else 0
    if outputs is not None:
        outputs.write(meta, rows)
        shown.lines(bench_report.foot(meta, rows))  # its warnings close the table
        if args.quiet:  # no table: stderr has them
            for warning in bench_report.warnings({**meta, "oversubscribed": []}, rows):
                print(f"mpistrat bench: WARNING: {warning}", file=sys.stderr, flush=True)
        if outputs.failed:
            code = 1
        if failed:
            print("mpistrat bench: WRONG RESULTS for " + ", ".join(failed), file=sys.stderr, flush=True)
    strategy.experimental_finalize()
    comm.Free()
    return code


def _sweep(
    strategy: mpistrat.MPIStrategy,
    comm: MPI.Intracomm,
    tasks: list[tuple[str, int]],
    args: Any,
    rtol: float,
    meta: dict[str, Any],
    outputs: _Outputs | None,
    shown: progress.Display,
) -> list[dict[str, Any]]:
    """Every size of every operation, each row shown and written as it is measured (rank 0);
    ``meta['partial']`` says why the rows stop short, None once they are all there."""
    rows: list[dict[str, Any]] = []
    seen: set[tuple[str, int]] = set()
    meta["partial"] = "the sweep did not finish (0 of its sizes measured)"
    if outputs is not None:
        shown.lines(bench_report.head(meta))
        outputs.write(meta, rows)
    done, began = 0, time.monotonic()
    try:
        with _Signals() as signals:
            for op_name, nbytes in tasks:
                case, timed = _one(strategy, comm, op_name, nbytes, args, rtol, seen)
                done += 1
                if timed is not None:
                    seen.add((op_name, case.nbytes))
                    row = _record(comm, op_name, case, timed, args)
                    row["oversubscribed"] = bool(meta["oversubscribed"])
                    rows.append(row)
                    meta["partial"] = f"the sweep did not finish ({done} of its {len(tasks)} sizes measured)"
                    if outputs is not None:
                        if len(rows) == 1 or rows[-2]["op"] != op_name:
                            shown.lines(bench_report.block_head(op_name, row["raw2"] is not None))
                        shown.lines([bench_report.row_line(row)])
                        outputs.write(meta, rows)
                shown.step(done, f"{op_name} {bench_report.human(nbytes)}", time.monotonic() - began)
                if stop := signals.agreed(comm):
                    meta["partial"] = (
                        f"stopped by {signal.Signals(stop).name} after {done} of its {len(tasks)} sizes "
                        f"({len(tasks) - done} not measured)"
                    )
                    return rows
    except KeyboardInterrupt:  # each rank on its own: rank 0 keeps what was measured, says why
        if outputs is not None:
            meta["partial"] = f"interrupted (SIGINT) after {done} of its {len(tasks)} sizes"
            outputs.write(meta, rows)
        raise
    meta["partial"] = None
    return rows


def _one(
    strategy: mpistrat.MPIStrategy,
    comm: MPI.Intracomm,
    op_name: str,
    nbytes: int,
    args: Any,
    rtol: float,
    seen: set[tuple[str, int]],
) -> tuple[Case, dict[str, Any] | None]:
    """One size of one operation: its case and timings (none for a size already timed)."""
    setup = Setup(
        strategy,
        comm,
        np.dtype(args.dtype),
        nbytes,
        args.leaves,
        args.batch,
        args.scaling,
        args.shard,
        rtol,
        args.checkpoint_dir,
    )
    # sizes below an op's smallest message (nest ops: one element per leaf) repeat it: time it once
    case, timed = _run_case(strategy, op_name, setup, args, seen)
    if setup.cleanups:  # the checkpoint ops' files, once every rank is done with them
        comm.Barrier()
        for cleanup in setup.cleanups:
            cleanup()
    return case, timed


if __name__ == "__main__":
    sys.exit(main())
