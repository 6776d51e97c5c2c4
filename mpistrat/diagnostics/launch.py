"""Whether the launcher's tasks became one MPI job, or each process a job of its own.

A launcher that the MPI library does not understand (``srun`` without the PMI plugin the
library speaks, another MPI's ``mpiexec``) still starts every task, but ``MPI_Init`` then
makes each one rank 0 of a world of one: N copies of the program train alone and write the
same files. The launcher's own count of tasks, in the environment, tells the two apart:

>>> problem(1, {"SLURM_STEP_NUM_TASKS": "4"}).split(" (MPI.COMM_WORLD")[0]
'srun started 4 tasks in this job step (SLURM_STEP_NUM_TASKS=4), but MPI started this process alone'
>>> problem(4, {"SLURM_STEP_NUM_TASKS": "4", "PMI_SIZE": "4"}) is None
True
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from mpi4py import MPI

from mpistrat import config
from mpistrat.errors import ContextError
from mpistrat.log import logger

__all__ = ["Launch", "check", "launched", "outside_launch", "problem"]

ALLOW = "MPISTRAT_ALLOW_SINGLETON"

# The launcher's count of the processes it started, most specific first: a process manager's
# (Hydra's mpiexec and srun's PMI plugins set PMI_SIZE, Open MPI's mpirun OMPI_COMM_WORLD_SIZE),
# then srun's step. Hydra under Slurm starts one proxy per node through srun, so there the step
# counts nodes, not ranks.
_COUNTS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
# What a launcher tells its processes: Hydra, PMI and PMIx, Open MPI and PRRTE, Intel MPI, Slurm.
_LAUNCHER = (
    "PMI_",
    "PMIX_",
    "HYDRA_",
    "HYDI_",
    "MPI_LOCAL",
    "OMPI_",
    "PRTE_",
    "I_MPI_HYDRA",
    "I_MPI_PMI",
    "SLURM_",
)


def outside_launch(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``os.environ``) without the launcher's variables: for a child interpreter that
    must not take itself for a rank of this job (MPI then starts it alone).

    >>> outside_launch({"PMI_RANK": "3", "SLURM_PROCID": "3", "HOME": "/home/u"})
    {'HOME': '/home/u'}
    """
    env = os.environ if env is None else env
    return {name: value for name, value in env.items() if not name.startswith(_LAUNCHER)}


@dataclasses.dataclass(frozen=True)
class Launch:
    """Who started this process and how many processes it started with it."""

    launcher: str  # "srun", "mpiexec" or "Open MPI's mpirun"
    tasks: int
    variable: str  # the environment variable that says so

    def __str__(self) -> str:
        plural = "s" if self.tasks != 1 else ""
        return f"{self.launcher}: {self.tasks} task{plural} ({self.variable}={self.tasks})"


def launched(env: Mapping[str, str] | None = None) -> Launch | None:
    """The launcher's count of tasks, from its variables; None when no launcher started this process."""
    env = os.environ if env is None else env
    for variable in _COUNTS:
        value = env.get(variable, "").strip()
        if not value.isdigit():
            continue
        tasks = int(value)
        if env.get("SLURM_STEP_NUM_TASKS", "").strip() == value:
            launcher = "srun"  # srun's own count, or its PMI plugin's (the same number)
        elif variable == "OMPI_COMM_WORLD_SIZE":
            launcher = "Open MPI's mpirun"
        else:
            launcher = "mpiexec"
        return Launch(launcher, tasks, variable)
    return None


def problem(world_size: int, env: Mapping[str, str] | None = None) -> str | None:
    """Why this process should not go on as a world of ``world_size`` (None: nothing wrong)."""
    env = os.environ if env is None else env
    if world_size != 1 or config.read(ALLOW, env):
        return None
    launch = launched(env)
    if launch is None or launch.tasks <= 1:
        return None
    if launch.launcher == "srun":
        started = f"srun started {launch.tasks} tasks in this job step"
        fix = (
            "srun and the MPI library did not agree on a process-management interface: name the one "
            "the library speaks, `srun --mpi=pmi2` for MPICH (the mpich wheel too), `srun --mpi=pmix` "
            "for Open MPI (`srun --mpi=list` shows what this Slurm offers), or start the ranks with the "
            "library's own mpiexec inside the allocation"
        )
    else:
        started = f"{launch.launcher} started {launch.tasks} processes"
        fix = (
            "Another MPI's launcher started it than the library mpi4py loaded: use the mpiexec installed "
            "with that library (with the mpich extra, the venv's bin/mpiexec)"
        )
    library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split(",")[0].split())
    return (
        f"{started} ({launch.variable}={launch.tasks}), but MPI started this process alone "
        f"(MPI.COMM_WORLD has 1 rank; mpi4py's MPI is {library}). Each task would train as rank 0 of 1 "
        f"and write the same files. {fix}. To run independent one-rank tasks on purpose, set {ALLOW}=1"
    )


def _outside_srun(world_size: int, env: Mapping[str, str]) -> str | None:
    """A job of several tasks whose program runs without srun or mpiexec: it uses one of them."""
    if world_size != 1 or config.read(ALLOW, env) or launched(env) is not None:
        return None
    tasks = env.get("SLURM_NTASKS", "").strip()
    if not tasks.isdigit() or int(tasks) <= 1:
        return None
    return (
        f"Slurm gave this job {tasks} tasks (SLURM_NTASKS={tasks}), but this program runs outside srun "
        "as one rank: start it with `srun --mpi=pmi2 python ...` (or the MPI's mpiexec) to use them "
        f"({ALLOW}=1 silences this)"
    )


_warned = False


def check(world_size: int, what: str = "MPIStrategy()") -> None:
    """Raise ``ContextError`` for a task that MPI started alone; warn (once) for a job's program run
    outside srun."""
    global _warned
    reason = problem(world_size)
    if reason is not None:
        raise ContextError(f"{what}: {reason}")
    note = None if _warned else _outside_srun(world_size, os.environ)
    if note is not None:
        _warned = True
        logger.warning("%s: %s", what, note)
