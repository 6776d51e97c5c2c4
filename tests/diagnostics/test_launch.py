"""A launch whose tasks did not join one MPI job: each process is rank 0 of 1 and would train alone.

The launcher's count of tasks comes from its environment; these tests set it as srun, Hydra's
mpiexec or Open MPI's mpirun would, around a process whose real MPI world is what MPI made it.
"""

import os
import subprocess
import sys

import pytest
from mpi4py import MPI

import mpistrat
from mpistrat import ContextError
from tests.conftest import all_ranks_agree

WORLD = MPI.COMM_WORLD
LAUNCHER_VARIABLES = (
    "PMI_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
    "MPISTRAT_ALLOW_SINGLETON",
)


@pytest.fixture
def launcher_env(monkeypatch):
    """Set the launcher's variables on top of none (this test's own launch's are put back after)."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("mpistrat.diagnostics.launch._warned", False)

    def set_env(**values: object) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return set_env


@pytest.mark.serial("a world of one process")
@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"SLURM_NTASKS": 4, "SLURM_STEP_NUM_TASKS": 4}, ["srun started 4 tasks", "SLURM_STEP_NUM_TASKS=4"]),
        ({"SLURM_STEP_NUM_TASKS": 4, "PMI_SIZE": 4}, ["srun started 4 tasks", "PMI_SIZE=4", "--mpi=pmi2"]),
        ({"PMI_SIZE": 3, "SLURM_STEP_NUM_TASKS": 1}, ["mpiexec started 3 processes", "PMI_SIZE=3"]),
        ({"OMPI_COMM_WORLD_SIZE": 2}, ["Open MPI's mpirun started 2 processes", "OMPI_COMM_WORLD_SIZE=2"]),
    ],
)
def test_a_task_that_mpi_started_alone_is_refused_with_the_fix(launcher_env, env, names):
    launcher_env(**env)
    with pytest.raises(ContextError) as raised:
        mpistrat.MPIStrategy()
    message = str(raised.value)
    assert message.startswith("MPIStrategy(): ") and "MPI started this process alone" in message
    for name in names:
        assert name in message, message
    assert "the mpiexec installed with that library" in message or "srun --mpi=pmix" in message
    assert message.endswith("To run independent one-rank tasks on purpose, set MPISTRAT_ALLOW_SINGLETON=1")


@pytest.mark.serial("a world of one process")
def test_the_override_runs_independent_one_rank_tasks_without_a_word(launcher_env, capsys):
    launcher_env(SLURM_NTASKS=4, SLURM_STEP_NUM_TASKS=4, MPISTRAT_ALLOW_SINGLETON=1)
    strategy = mpistrat.MPIStrategy()
    assert strategy.num_replicas_in_sync == 1
    strategy.experimental_finalize()
    assert "srun" not in capsys.readouterr().err


@pytest.mark.serial("a world of one process")
def test_a_job_script_that_runs_the_program_without_srun_warns_once(launcher_env, capsys):
    """In the batch script itself (no step): one of the allocation's tasks is used, nothing duplicated."""
    launcher_env(SLURM_JOB_ID=7, SLURM_NTASKS=4)
    strategies = [mpistrat.MPIStrategy(), mpistrat.MPIStrategy()]
    err = capsys.readouterr().err
    assert err.count("WARNING: MPIStrategy(): Slurm gave this job 4 tasks (SLURM_NTASKS=4)") == 1, err
    assert "start it with `srun --mpi=pmi2 python ...`" in err
    for strategy in strategies:
        strategy.experimental_finalize()


@pytest.mark.parametrize("hydra_under_slurm", [False, True])
def test_a_launch_that_joined_its_tasks_is_accepted_at_any_size(launcher_env, capsys, hydra_under_slurm):
    """srun with a working PMI, or Hydra starting one proxy per node through srun: no false alarm."""
    size = WORLD.Get_size()
    step = 1 if hydra_under_slurm else size  # Hydra's proxies are srun's tasks, one per node
    launcher_env(SLURM_JOB_ID=7, SLURM_NTASKS=2 * size, SLURM_STEP_NUM_TASKS=step, PMI_SIZE=size)
    strategy = mpistrat.MPIStrategy()
    ok = strategy.num_replicas_in_sync == size
    strategy.experimental_finalize()
    err = capsys.readouterr().err
    all_ranks_agree(WORLD, ok and "WARNING" not in err, err)


@pytest.mark.serial("starts its own process")
def test_mpistrat_info_names_a_launch_that_did_not_join(tmp_path):
    launchers = ("PMI_", "HYDI_", "OMPI_", "PMIX_", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launchers)}
    env.update(SLURM_NTASKS="4", SLURM_STEP_NUM_TASKS="4", SLURM_PROCID="2", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "mpistrat", "info"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "srun started 4 tasks in this job step (SLURM_STEP_NUM_TASKS=4)" in done.stderr, done.stderr
    assert "launch            srun: 4 tasks (SLURM_STEP_NUM_TASKS=4); MPI: 1 rank" in done.stdout, done.stdout
