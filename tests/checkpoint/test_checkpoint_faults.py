"""Faults while a checkpoint is written, each in a job of its own: a full disk, a read-only
directory, a rank killed while writing, two jobs saving into one directory. Each ends in an
error on every rank (or the job's end) with the previous checkpoint intact and restorable.

The full disk and the read-only directory are real: a small tmpfs mounted in a mount namespace
of the job's own (root and ``unshare`` needed; skipped otherwise).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mpistrat
from tests.support.launch import MPIEXEC, ROOT, is_open_mpi, job_environment, launcher_options, run_job

pytestmark = pytest.mark.serial
JOB = Path(__file__).parent / "checkpoint_fault_job.py"


def _can_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


needs_mount = pytest.mark.skipif(not _can_mount(), reason="needs root and unshare to mount a small tmpfs")


def in_tmpfs(directory: Path, size: str, then: str = "") -> list[str]:
    """A command prefix: run the job in a mount namespace where ``directory`` is a tmpfs of ``size``."""
    script = f'mount -t tmpfs -o size={size} tmpfs {directory} && {then} exec "$0" "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script]


def restored(path: Path, n: int) -> bool:
    v = mpistrat.Variable(np.zeros(n))
    mpistrat.Checkpoint(v=v).restore(path).assert_consumed()
    return bool(np.array_equal(v.numpy(), np.arange(n, dtype=np.float64)))


@needs_mount
def test_a_full_disk_fails_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "small"
    directory.mkdir()
    code, out = run_job(
        JOB, "full", str(directory), "200000", ranks=3, limit=90, prefix=in_tmpfs(directory, "1m")
    )
    assert code == 0, out
    enospc = "OSError 28"
    # Open MPI's MPI-IO reports an I/O error without the system's errno; MPICH's names it.
    said = "OSError 5" if is_open_mpi() else enospc
    assert f"sync: ['{said}', '{said}', '{said}'] counter 0" in out, out  # a failed save does not count
    assert f"async: ['{enospc}', '{enospc}', '{enospc}']" in out, out  # POSIX writes: the errno itself
    assert "restored ckpt-1 True" in out and "files ['checkpoint', 'ckpt-1']" in out, out


@needs_mount
def test_a_read_only_directory_fails_every_rank_and_still_restores(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    # A first job writes ckpt-1, then the file system turns read-only.
    save = subprocess.list2cmdline(run_args(directory, "save", "1000"))
    first = f"{save} && mount -o remount,ro {directory} &&"
    code, out = run_job(
        JOB, "readonly", str(directory), ranks=2, limit=90, prefix=in_tmpfs(directory, "4m", first)
    )
    assert code == 0, out
    assert "save: ['OSError 30', 'OSError 30']" in out and "restored True" in out, out


def run_args(directory: Path, mode: str, *args: str) -> list[str]:
    """The command line of a 2-rank job of this module's job script (to run inside another command)."""
    return [
        str(MPIEXEC),
        *launcher_options(),
        "-n",
        "2",
        sys.executable,
        str(JOB),
        mode,
        str(directory),
        *args,
    ]


def test_a_rank_killed_while_writing_ends_the_job_and_leaves_the_previous_checkpoint(tmp_path):
    code, out = run_job(JOB, "kill", str(tmp_path), ranks=3, limit=90)
    assert code != 0 and "saving" in out and "not killed" not in out, out
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[:2] == ["checkpoint", "ckpt-1"] and any(".tmp" in n for n in names[2:]), names
    assert mpistrat.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-1")
    assert restored(tmp_path / "ckpt-1", 20000)
    # The next save (here: one rank) reclaims what the killed one left.
    v = mpistrat.Variable(np.arange(5.0))
    mpistrat.Checkpoint(v=v).save(tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "ckpt-1", "other-1"]


def test_two_jobs_saving_into_one_directory_leave_valid_files(tmp_path):
    jobs = [
        subprocess.Popen(
            run_args(tmp_path, "repeat", prefix, "6"),
            cwd=ROOT,
            env=job_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for prefix in ("a", "bb")
    ]
    outs = [job.communicate(timeout=90)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outs
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "a-1",
        "a-2",
        "a-3",
        "a-4",
        "a-5",
        "a-6",
        "bb-1",
        "bb-2",
        "bb-3",
        "bb-4",
        "bb-5",
        "bb-6",
        "checkpoint",
    ]
    for name in names[:-1]:  # each file whole, each with its own job's values
        v = mpistrat.Variable(np.zeros(30000))
        mpistrat.Checkpoint(v=v).restore(tmp_path / name).assert_consumed()
        assert np.array_equal(v.numpy(), np.arange(30000.0) + len(name.split("-")[0])), name
    assert mpistrat.latest_checkpoint(tmp_path) in (str(tmp_path / "a-6"), str(tmp_path / "bb-6"))
