"""How long ranks take to start, and the file system calls each makes: the table in docs/scaling.md.

    python -m benchmarks.startup                           # 1, 4, 16, 64 ranks; staged and not
    python -m benchmarks.startup --ranks 1 4 --baseline-source /tmp/old/   # + an older mpistrat

Each job runs one small program under ``mpiexec -n N``: import numpy and mpi4py (MPI_Init),
import mpistrat, make an ``MPIStrategy`` and run one ``all_reduce``; each rank notes its age
(seconds since the kernel started it, from ``/proc``: no clock of mpistrat's) at each point.
``raw`` is the same program with raw mpi4py (an ``Allreduce`` on COMM_WORLD). Variants:

- ``unstaged``: the venv's python, as installed (an editable mpistrat: its source tree);
- ``staged``: the venv packed by ``mpistrat stage --pack``, unpacked once into ``/dev/shm``, its
  python started by every rank (the pack and unpack are timed once, apart);
- ``baseline``: the venv's python with another mpistrat source tree first on ``PYTHONPATH``.

Each job is timed ``--repeats`` times, the variants in turn; the table gives the median over the
jobs of their median and of their slowest rank. Traced runs are apart (``strace -f -e
trace=%file`` slows a start): per rank,
the calls on the environment's file system (its prefix, base interpreter, mpistrat's source:
what is a shared file system on a cluster) and on the staged copy. One machine: the ranks beyond
its cores are oversubscribed, and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mpistrat.tools import startup_info
from tests.support import staged as test_pack
from tests.support.launch import ROOT, job_environment, launcher_options

AGE = """
def age():
    with open("/proc/self/stat") as stat, open("/proc/uptime") as clock:
        start = int(stat.read().rsplit(")", 1)[1].split()[19])
        return float(clock.read().split()[0]) - start / os.sysconf("SC_CLK_TCK")
"""
PROGRAM = (
    "import json, os, sys\n" + AGE + "import numpy\nfrom mpi4py import MPI\npoints = [age()]\n"
    "import mpistrat\npoints.append(age())\n"
    "s = mpistrat.MPIStrategy()\n"
    "s.run(lambda: mpistrat.get_replica_context().all_reduce('sum', numpy.ones(2)))\npoints.append(age())\n"
    "json.dump(points, open(f'{sys.argv[1]}/rank-{MPI.COMM_WORLD.Get_rank()}.json', 'w'))\n"
)
RAW = (
    "import json, os, sys\n" + AGE + "import numpy\nfrom mpi4py import MPI\npoints = [age(), None]\n"
    "MPI.COMM_WORLD.Allreduce(numpy.ones(2), numpy.empty(2))\npoints.append(age())\n"
    "json.dump(points, open(f'{sys.argv[1]}/rank-{MPI.COMM_WORLD.Get_rank()}.json', 'w'))\n"
)


def launch(python: str, script: Path, ranks: int, out: Path, env: dict[str, str], trace: Path | None) -> None:
    mpiexec = Path(python).parent / "mpiexec"
    command = [str(mpiexec), *launcher_options(), "-n", str(ranks), python, str(script), str(out)]
    if trace is not None:
        command = ["strace", "-f", "-y", "-qq", "-e", "trace=%file", "-o", str(trace), *command]
    done = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{command[:6]}... failed:\n{done.stderr[-3000:]}")


def per_rank_calls(trace: Path, python: str, original: list[str], stage: str | None) -> list[tuple[int, int]]:
    """Each rank's (calls on the original environment, calls on the staged copy)."""
    lines: dict[str, list[str]] = {}
    ranks = set()
    with open(trace, errors="replace") as f:
        for line in f:
            pid = line.split(" ", 1)[0]
            lines.setdefault(pid, []).append(line)
            if f'execve("{python}"' in line:
                ranks.add(pid)
    table = startup_info.mounts()
    out = []
    for pid in sorted(ranks):
        env = startup_info.calls_by_location(lines[pid], table, environment=original)["environment"]
        copy = (
            startup_info.calls_by_location(lines[pid], table, environment=[stage])["environment"]
            if stage
            else 0
        )
        out.append((env, copy))
    return out


def timed(python: str, program: str, ranks: int, env: dict[str, str]) -> list[list[float | None]]:
    """One job's points per rank: ages at MPI_Init, after import mpistrat, after the first collective."""
    with tempfile.TemporaryDirectory(prefix="startup-") as work:
        folder = Path(work)
        script = folder / "job.py"  # not -c: the repository must not be on the ranks' path
        script.write_text(program)
        launch(python, script, ranks, folder, env, None)
        return [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(ranks)]


def traced(
    python: str, program: str, ranks: int, env: dict[str, str], original: list[str], stage: str | None
) -> dict:
    """One traced job: per rank, calls on the environment and on the staged copy (median, max)."""
    with tempfile.TemporaryDirectory(prefix="startup-") as work:
        folder = Path(work)
        script = folder / "job.py"
        script.write_text(program)
        launch(python, script, ranks, folder, env, folder / "trace")
        calls = per_rank_calls(folder / "trace", python, original, stage)
    return {
        "env_calls": (statistics.median(c[0] for c in calls), max(c[0] for c in calls)),
        "stage_calls": (statistics.median(c[1] for c in calls), max(c[1] for c in calls)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--baseline-source", help="a directory holding another mpistrat/ to compare with")
    parser.add_argument("--repeats", type=int, default=3, help="timed jobs per rank count and variant")
    parser.add_argument("--no-trace", action="store_true", help="time only")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    original = [sys.prefix, sys.base_prefix, str(ROOT / "mpistrat")]
    env = job_environment()
    env.pop("PYTHONPATH", None)  # the venv's own mpistrat (editable: the source tree)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a start reads compiled modules, as installed ones are
    started = time.monotonic()
    pack = test_pack.pack()
    packed = time.monotonic() - started
    stage = Path(tempfile.mkdtemp(dir="/dev/shm")) / "stage"
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "mpistrat", "stage", "--unpack", str(pack), str(stage)],
                   env={**env, "MPI4PY_RC_INITIALIZE": "0"}, check=True, capture_output=True)  # fmt: skip
    unpacked = time.monotonic() - started
    staged = str(stage / "venv" / "bin" / "python")
    variants = [
        ("raw", sys.executable, RAW, env, None),
        ("unstaged", sys.executable, PROGRAM, env, None),
        ("staged", staged, PROGRAM, env, str(stage)),
    ]
    if args.baseline_source:
        source = str(Path(args.baseline_source).resolve())
        original.append(str(Path(source) / "mpistrat"))
        variants.append(("baseline", sys.executable, PROGRAM, {**env, "PYTHONPATH": source}, None))
    rows = []
    try:
        for _, python, program, variant_env, _ in variants:  # a first start compiles the modules
            timed(python, program, 1, variant_env)
        for ranks in args.ranks:
            jobs: dict[str, list[list[float]]] = {name: [] for name, *_ in variants}
            for _ in range(args.repeats):  # the variants in turn, so that a busier minute hits them alike
                for name, python, program, variant_env, _ in variants:
                    firsts = [p[2] for p in timed(python, program, ranks, variant_env)]
                    jobs[name].append([statistics.median(firsts), max(firsts)])
            for name, python, program, variant_env, copy in variants:
                row = {"variant": name, "ranks": ranks, "jobs": jobs[name]}
                row["first_median"] = statistics.median(j[0] for j in jobs[name])
                row["first_slowest"] = statistics.median(j[1] for j in jobs[name])
                if not args.no_trace and shutil.which("strace"):
                    row.update(traced(python, program, ranks, variant_env, original, copy))
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(stage.parent, ignore_errors=True)
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0]
    print(f"\npack {pack.stat().st_size / 2**20:.0f} MiB (made in {packed:.1f} s, or found current); "
          f"unpacked in {unpacked:.1f} s; {cores} cores (*: oversubscribed); load {load:.1f}")  # fmt: skip
    print("| ranks | variant | start to first collective, median s | slowest s "
          "| calls/rank on the environment (median, max) | on the staged copy |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        star = "*" if r["ranks"] > cores else ""
        env_calls = "{:.0f}, {:.0f}".format(*r["env_calls"]) if "env_calls" in r else "-"
        copy = (
            "{:.0f}, {:.0f}".format(*r["stage_calls"])
            if "stage_calls" in r and r["variant"] == "staged"
            else "-"
        )
        print(f"| {r['ranks']}{star} | {r['variant']} | {r['first_median']:.2f} | {r['first_slowest']:.2f} | "
              f"{env_calls} | {copy} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
