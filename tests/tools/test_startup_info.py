"""``mpistrat info --startup``: each rank's start, its file system calls by location, and the hint to stage.

The counts of a trace are checked against ``strace -c``'s own count of the same start, and a
hand-written excerpt against counts made by eye; the points of a job against its wall time.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from mpistrat.tools import startup_info
from tests.support.launch import ROOT, job_environment
from tests.tools.test_bench import mpiexec

pytestmark = pytest.mark.serial("starts its own jobs, or reads files only")

# (mount point, type), the longest first, as startup_info.mounts() gives them
TABLE = [("/dev/shm", "tmpfs"), ("/shared", "lustre"), ("/proc", "proc"), ("/sys", "sysfs"), ("/", "ext4")]

# A few lines of `strace -f -y -e trace=%file`: a path, a descriptor with its path, a path relative
# to a descriptor, a call without a path (getcwd: the working directory), a failed lookup, and
# lines that are no call.
EXCERPT = [
    '101 openat(AT_FDCWD</home/u>, "/shared/venv/lib/os.py", O_RDONLY) = 3</shared/venv/lib/os.py>',
    '101 newfstatat(3</shared/venv/lib/os.py>, "", {st_mode=S_IFREG|0644}, AT_EMPTY_PATH) = 0',
    '101 openat(AT_FDCWD</home/u>, "/dev/shm/stage/venv/x.py", O_RDONLY) = -1 ENOENT (No such file)',
    '102 readlinkat(5</sys/class/net>, "eth0", "../../devices/virtual", 256) = 21',
    '102 openat(AT_FDCWD</home/u>, "/proc/self/io", O_RDONLY) = 4</proc/102/io>',
    '102 getcwd("/site/work", 4096) = 11',
    "102 +++ exited with 0 +++",
    "101 --- SIGCHLD {si_signo=SIGCHLD} ---",
]


def test_a_trace_is_counted_by_where_each_call_goes():
    got = startup_info.calls_by_location(EXCERPT, TABLE, environment=["/shared/venv"], shared=["/site"])
    # by eye: 2 calls in /shared (lustre), 1 in /dev/shm (tmpfs), /sys and /proc, and getcwd in
    # /site, shared by MPISTRAT_SHARED_PATHS; the first two are in the environment
    assert got == {"calls": 6, "shared": 3, "node-local": 1, "kernel": 2, "environment": 2}


def test_a_path_is_on_the_file_system_of_its_longest_mount_point():
    table = TABLE
    assert startup_info.kind_of("/shared/venv/bin/python", table) == "shared"
    assert startup_info.kind_of("/sharedness/x", table) == "node-local"  # not under /shared
    assert startup_info.kind_of("/dev/shm/mpistrat-7/venv", table) == "node-local"
    assert startup_info.kind_of("/proc/self/stat", table) == "kernel"
    assert startup_info.kind_of("/opt/app", table, shared=["/opt"]) == "shared"


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
def test_the_traced_start_counts_what_strace_counts():
    traced = startup_info.traced_calls()
    if traced is None:
        pytest.skip("strace cannot trace here (ptrace refused?)")
    summary = subprocess.run(
        [
            "strace",
            "-f",
            "-c",
            "-e",
            "trace=%file",
            "-o",
            "/dev/stderr",
            sys.executable,
            "-c",
            startup_info.PROBE,
        ],
        env=job_environment(),
        capture_output=True,
        text=True,
        timeout=120,
    ).stderr.splitlines()
    total = int(next(line for line in summary if line.rstrip().endswith("total")).split()[3])
    assert traced["calls"] == traced["shared"] + traced["node-local"] + traced["kernel"]
    assert abs(traced["calls"] - total) <= 0.03 * total, (traced, total)  # two runs of one start
    assert 0 < traced["environment"] < traced["calls"]


def test_the_command_at_three_ranks_reports_each_start_and_hints_at_staging():
    """The environment counted as shared (MPISTRAT_SHARED_PATHS) and not staged: the hint says so."""
    env = job_environment({"MPISTRAT_SHARED_PATHS": sys.prefix})
    began = time.monotonic()
    done = subprocess.run(
        [
            *mpiexec(),
            "-n",
            "3",
            sys.executable,
            "-m",
            "mpistrat",
            "info",
            "--startup",
            "--json",
            "--no-trace",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = time.monotonic() - began
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["size"] == 3 and [r["rank"] for r in info["ranks"]] == [0, 1, 2]
    for r in info["ranks"]:
        points = [r["points"][p] for p in ("MPI_Init", "import mpistrat", "first collective")]
        assert 0 < points[0] <= points[1] <= points[2] < elapsed, r  # each after its start, within the job
        assert r["mpi_before_mpistrat"] is False and r["reads"]["syscr"] > 0
        prefix = r["environment"]["prefix"]
        assert prefix["path"] == sys.prefix and prefix["kind"] == "shared"
        assert r["environment"]["staged"] is None and r["traced"] is None
    slowest = max(r["points"]["first collective"] for r in info["ranks"])
    assert info["summary"]["first collective"]["slowest"] == slowest
    assert "not staged" in info["hint"] and sys.prefix in info["hint"]
    text = startup_info.render(info)
    assert "hint: the environment is on a shared file system" in text and "first collective" in text


def test_without_a_shared_file_system_there_is_no_hint():
    record = {"rank": 0, "environment": startup_info.environment()}
    kinds = {record["environment"][n]["kind"] for n in ("prefix", "base_prefix", "mpistrat")}
    assert (startup_info.hint([record]) is None) == ("shared" not in kinds)
