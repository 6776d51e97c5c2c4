"""Compare two versions of mpistrat with ``mpistrat bench`` in one run, rounds interleaved.

Each round runs the same benchmark under ``mpiexec`` once per source tree (a git worktree of
the older commit, and this one), alternating, so that a noisy machine slows both alike. The
table shows each side's median over the rounds, next to raw mpi4py measured in the same runs.

    git worktree add --detach /tmp/before <commit>
    python -m benchmarks.bench_versions /tmp/before . --ranks 2 --rounds 3 \\
        --ops all_reduce,all_reduce_nest,all_gather_uneven --max 4MiB
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mpistrat.tools.bench_report import human


def run(tree: Path, ranks: int, bench_args: list[str], out: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec), "-n", str(ranks), sys.executable, "-m", "mpistrat", "bench", "--quiet"]
    subprocess.run([*cmd, *bench_args, "--json", str(out)], env=env, check=True, cwd=tree, timeout=1800)
    return json.loads(out.read_text())["results"]


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("before", type=Path, help="source tree of the older version")
    parser.add_argument("after", type=Path, help="source tree of the newer version")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every round's results here")
    args, bench_args = parser.parse_known_args()
    times: dict[tuple[str, int], dict[str, list[float]]] = {}
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side, tree in (("before", args.before), ("after", args.after)):
                results = run(tree, args.ranks, bench_args, Path(tmp) / f"{side}-{r}.json")
                rounds.append({"round": r, "side": side, "results": results})
                for row in results:
                    cell = times.setdefault((row["op"], row["bytes"]), {})
                    cell.setdefault(side, []).append(row["mpistrat"]["time_us"]["avg"])
                    cell.setdefault("raw", []).append(row["raw"]["time_us"]["avg"])
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=1))
    print(f"{args.ranks} ranks, median of {args.rounds} rounds")
    print("| op | size | before µs | after µs | after - before | raw µs | after / raw |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (op, size), cell in sorted(times.items()):
        if "before" not in cell or "after" not in cell:
            continue
        before, after, raw = (statistics.median(cell[k]) for k in ("before", "after", "raw"))
        print(
            f"| {op} | {human(size)} | {before:.1f} | {after:.1f} | {after - before:+.1f} | {raw:.1f} | "
            f"{after / raw:.2f} |"
        )


if __name__ == "__main__":
    main()
