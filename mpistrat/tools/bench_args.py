"""What ``mpistrat bench`` accepts: its options, and the checks made before the sweep starts.

Bad values are refused with the reason (exit 2) on every rank alike: names that are no
operation, sizes out of order, counts below their least value (``--iters``, ``--warmup``, ...),
and (:func:`memory_problem`) a largest size whose buffers would not fit in the memory of the
host, found before anything is allocated.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from mpistrat.comm.mpi import mpi_datatype
from mpistrat.errors import MpistratError
from mpistrat.tools import bench_report
from mpistrat.tools.bench_ops import DEFAULT_OPS, GROUPS, OPS, OPT_IN
from mpistrat.tools.host import HostLoad
from mpistrat.tools.sizes import parse_size

__all__ = ["memory_problem", "notes", "parser", "tolerance", "unusable_directory", "unwritable", "validate"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpistrat bench",
        description="Time mpistrat collectives against raw mpi4py on the same buffers (under mpiexec/srun).",
    )
    p.add_argument(
        "--ops",
        default=",".join(DEFAULT_OPS),
        help=f"comma-separated, from {', '.join(OPS)}; 'checkpoint' is both checkpoint ops "
        f"(default: all but {', '.join(OPT_IN)})",
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
        default=None,
        help="a scaling study's mode, recorded for report and plot; train_step's batch is global "
        "(strong) or per rank (weak, and when unset)",
    )
    p.add_argument("--batch", type=int, default=256, help="train_step batch size (default 256)")
    p.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        default=None,
        help="checkpoint ops: where their files go, removed afterwards (default: the current "
        "directory; on a cluster, the parallel file system a job writes to)",
    )
    p.add_argument(
        "--shard",
        action="store_true",
        help="apply_gradients ops: the mpistrat optimizer shards its state (shard_state=True)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="CommunicationOptions(deterministic=True): exact floating-point sums (docs/concepts.md)",
    )
    p.add_argument(
        "--compression",
        choices=("bf16", "fp16"),
        default=None,
        help="CommunicationOptions.compression: 16-bit values on the wire for float sums (not the "
        "apply_gradients ops, whose checks are exact to rounding)",
    )
    p.add_argument("--label", default=None, help="name of this run in tables and plots")
    p.add_argument("--json", metavar="PATH", help="write results and metadata as JSON")
    p.add_argument(
        "--csv",
        metavar="PATH",
        help="write results as CSV, one row per operation and size (main metadata repeated in columns)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on rank 0 (default: when the job was started from a terminal)",
    )
    p.add_argument("--quiet", action="store_true", help="no table")
    return p


def validate(args: Any, parser: argparse.ArgumentParser) -> list[str]:
    """The ops named, once every argument was checked (``parser.error`` otherwise: exit 2)."""
    named = [o.strip() for o in args.ops.split(",") if o.strip()]
    ops = list(dict.fromkeys(op for o in named for op in GROUPS.get(o, (o,))))
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
    if args.warmup is not None and args.warmup < 0:  # a negative count would time nothing for some
        parser.error(f"--warmup: expected an integer >= 0 (0: no warm-up); got {args.warmup}")
    if args.min > args.max:
        parser.error(f"--min ({args.min}) is larger than --max ({args.max})")
    if args.compression and args.deterministic:
        parser.error("--compression and --deterministic: choose one (exact sums are not compressed)")
    optimizers = [o for o in ops if o.startswith("apply_gradients")]
    if args.compression and optimizers:
        parser.error(
            f"--compression: not with {', '.join(optimizers)} (their check is exact to rounding); "
            "time them without it"
        )
    return ops


def tolerance(args: Any, size: int) -> float:
    """How far a compressed sum may be from the exact one, relative to it (all terms positive):
    (2u + (R+1) 2^-24)(1 + u), u the 16-bit format's unit roundoff (docs/concepts.md)."""
    if not args.compression:
        return 0.0
    u = 2.0**-8 if args.compression == "bf16" else 2.0**-11
    return (2 * u + (size + 1) * 2.0**-24) * (1 + u)


def unwritable(path: str | None) -> str | None:
    """Why ``path`` cannot be written, or None: tried before the sweep, not found out after it.

    Creates the missing folders (the writer would) and opens the file for appending; a file
    that was not there before is removed again.
    """
    if not path:
        return None
    target = os.path.abspath(path)
    existed = os.path.exists(target)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "a"):
            pass
        if not existed:
            os.remove(target)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def unusable_directory(path: str | None) -> str | None:
    """Why the checkpoint ops cannot write their files under ``path`` (None: the current directory),
    or None: tried before the sweep (a folder and a file made in it, then removed)."""
    parent = os.path.abspath(path or os.getcwd())
    if os.path.exists(parent) and not os.path.isdir(parent):
        return "not a directory"
    try:
        os.makedirs(parent, exist_ok=True)
        trial = tempfile.mkdtemp(prefix="mpistrat-bench-trial-", dir=parent)
        try:
            with open(os.path.join(trial, "file"), "wb") as f:
                f.write(b"x")
        finally:
            shutil.rmtree(trial, ignore_errors=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def notes(args: Any, sizes: list[int]) -> list[str]:
    """What rank 0 says about the sizes asked for before the sweep."""
    notes = []
    if sizes and sizes[-1] != args.max:
        notes.append(
            f"--max {args.max} is not a power of two: the largest size is {bench_report.human(sizes[-1])}"
        )
    if sizes and sizes[0] != args.min:
        notes.append(f"--min {args.min} is not a power of two: the smallest size is {sizes[0]} B")
    return notes


def memory_problem(
    ops: list[str], largest: int, ranks: int, here: HostLoad, available: int | None
) -> str | None:
    """Why ``largest`` cannot be timed on this rank's host (its ranks' footprint exceeds the memory
    ``available`` there), or None. Every op's :attr:`~mpistrat.tools.bench_case.Op.footprint` is
    measured: the sweep would otherwise end in an out-of-memory kill, the job aborted."""
    if available is None:  # not Linux: nothing to go by
        return None
    name = max(ops, key=lambda o: OPS[o].bytes_needed(largest, ranks))
    need = OPS[name].bytes_needed(largest, ranks)
    if need * here.ranks <= available:
        return None
    fits = largest
    while fits > 1 and OPS[name].bytes_needed(fits, ranks) * here.ranks > available:
        fits //= 2
    return (
        f"--max {bench_report.human(largest)}: {name} holds about {_gib(need)} per rank at that size, "
        f"{_gib(need * here.ranks)} for the {here.ranks} rank(s) on {here.host}, which has {_gib(available)} "
        f"available; the largest size that fits is about {bench_report.human(fits)} (lower --max)"
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):,.1f} GiB"
