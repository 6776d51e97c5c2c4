"""Instructions per call of mpistrat's small-collective paths, counted by valgrind: no timing noise.

    python -m benchmarks.instructions [--short 200] [--long 2200] [--jobs 2]

A shared machine moves a microsecond-scale timing by tens of percent between runs; the number of
instructions a path executes does not. Each line runs one loop under ``valgrind --tool=callgrind``
twice, ``--short`` and ``--long`` times (one process, ``COMM_SELF``; hash seed, address layout,
one BLAS thread and the garbage collector fixed), and prints the difference per iteration: the
loop's own cost, the import and setup cancelled. At two ranks the collectives are watched and the
handshake is a persistent collective (``--watched`` gives the one process both, as there), and the
transfer's waiting comes on top. About 8,500 instructions take a microsecond on the machine
``docs/performance.md`` quotes.

Paths: ``raw`` (``comm.Allreduce`` of 8 float64, the floor), ``call`` (``ReplicaContext.all_reduce``
of the same array) and ``step`` (8 such calls and ``strategy.run``'s closing, as
``mpistrat.tools.bench_check`` times at two ranks), per check setting.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import os
import re
import shutil
import subprocess
import sys

SETTINGS = {"off": False, "on": True, "step": "step"}


def loop(path: str, check: str, n: int, watched: bool) -> None:
    """Run ``path`` ``n`` times (what valgrind counts)."""
    import numpy as np
    from mpi4py import MPI

    import mpistrat
    from mpistrat.distribute import results

    gc.disable()
    options = mpistrat.CommunicationOptions(check=SETTINGS[check])
    strategy = mpistrat.MPIStrategy(MPI.COMM_SELF.Dup(), communication_options=options)
    collectives = strategy.extended.collectives
    collectives.monitor.watched = watched
    if watched:  # and the persistent handshake, as at two ranks (one rank has none: nobody to wait for)
        send, recv, _, messages, stop = collectives.handshake_buffers
        request = collectives.comm.Allreduce_init(messages[0], messages[1], MPI.MAX)
        collectives.handshake_buffers = (send, recv, request, messages, stop)
        collectives.requests.append(request)
    x, out = np.ones(8), np.empty(8)

    def body() -> None:
        ctx = mpistrat.get_replica_context()
        if path == "raw":
            for _ in range(n):
                collectives.comm.Allreduce(x, out, MPI.SUM)
        elif path == "call":
            for _ in range(n):
                ctx.all_reduce("sum", x)
        else:  # the step: what strategy.run does after fn, at two ranks or more
            for _ in range(n):
                results.agree_on_result(collectives, [ctx.all_reduce("sum", x) for _ in range(8)], None)

    strategy.run(body)


def count(path: str, check: str, n: int, watched: bool) -> int:
    command = [
        *("setarch", "-R", "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"),
        *(sys.executable, "-m", "benchmarks.instructions", "--run", path, check, str(n)),
        *(["--watched"] if watched else []),
    ]
    # One BLAS thread: OpenBLAS's idle threads spin, and valgrind counts their instructions too.
    env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return int(re.search(r"Collected : (\d+)", done.stderr).group(1))  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=200)
    parser.add_argument("--long", type=int, default=2200)
    parser.add_argument("--jobs", type=int, default=2, help="valgrind runs at once")
    parser.add_argument(
        "--watched", action="store_true", help="the watchdog's path and a persistent handshake, as at 2 ranks"
    )
    parser.add_argument("--run", nargs=3, metavar=("PATH", "CHECK", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        loop(args.run[0], args.run[1], int(args.run[2]), args.watched)
        return
    if shutil.which("valgrind") is None or shutil.which("setarch") is None:
        sys.exit("needs valgrind and setarch (util-linux)")
    lines = [("raw", "off")] + [(path, check) for path in ("call", "step") for check in SETTINGS]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        counts = {
            line: [pool.submit(count, *line, n, args.watched) for n in (args.short, args.long)]
            for line in lines
        }
        per = {
            line: (long.result() - short.result()) / (args.long - args.short)
            for line, (short, long) in counts.items()
        }
    print(f"instructions per iteration ({'watched' if args.watched else 'unwatched'}; one process)")
    for (path, check), value in per.items():
        print(f"{path:5s} {'' if path == 'raw' else check:5s} {value:10,.0f}")


if __name__ == "__main__":
    main()
