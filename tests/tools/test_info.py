"""``mpistrat info``: in-process at every rank count, and as a command at 1 and 2 ranks (serial pass only)."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from mpistrat.tools import info
from tests.conftest import WORLD, RankChecks, all_ranks_agree
from tests.support.launch import launcher_options

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_", "MPI_LOCAL", "MPIR_", "I_MPI_")


def test_collect_on_every_rank_count():
    got = info.collect()
    if WORLD.Get_rank() != 0:
        all_ranks_agree(WORLD, got is None, "only rank 0 gets the report")
        return
    ranks = got["ranks"]
    checks = RankChecks()
    checks.that(
        got["size"] == WORLD.Get_size() and [r["rank"] for r in ranks] == list(range(WORLD.Get_size()))
    )
    checks.that(sum(got["ranks_per_node"].values()) == WORLD.Get_size())
    checks.that(all(r["host"] in got["ranks_per_node"] for r in ranks))
    checks.that(all(r["device"].startswith(f"/job:worker/replica:0/task:{r['rank']}/device:") for r in ranks))
    checks.that(bool(got["mpi4py"]) and got["host_transport"] == "mpi")
    checks.that(got["step_check"] in ("compiled", "Python (not built)", "Python (MPISTRAT_NATIVE=0)"))
    checks.that(set(got["device_transport"]) == {"AUTO", "RING", "NCCL"})
    live, why = got["fault_tolerance"]  # launched here without ULFM (make test-openmpi-faults launches it)
    checks.that(
        not live and "--with-ft ulfm" in why and "a rank's death    ends the job: " in info.render(got)
    )
    checks.agree(WORLD, json.dumps(got, default=str))


def test_cores_bindings_and_threads_are_shown_and_oversubscription_named(monkeypatch):
    """Each host's ranks against the logical cores they may use, from every rank's binding (raw
    mpi4py here); at 3 or 4 ranks on a 2-core machine that is oversubscribed, and said so."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    mine = (MPI.Get_processor_name(), sorted(os.sched_getaffinity(0)))
    everyone = WORLD.allgather(mine)
    got = info.collect()
    if WORLD.Get_rank() != 0:
        all_ranks_agree(WORLD, got is None)
        return
    hosts: dict[str, tuple[int, set[int]]] = {}
    for name, cpus in everyone:
        ranks, union = hosts.get(name, (0, set()))
        hosts[name] = (ranks + 1, union | set(cpus))
    crowded = [n for n, (ranks, union) in hosts.items() if ranks > len(union)]
    text = info.render(got)
    checks = RankChecks()
    checks.that([r["cpus"] for r in got["ranks"]] == [cpus for _, cpus in everyone])
    checks.that(len(got["oversubscribed"]) == len(crowded) and ("OVERSUBSCRIBED" in text) == bool(crowded))
    checks.that("OMP_NUM_THREADS=3" in text and got["threads"]["OMP_NUM_THREADS"] == "3")
    ranks, union = hosts[mine[0]]
    checks.that(f"{ranks} rank{'s' if ranks > 1 else ''} on {len(union)} logical core" in text)
    checks.agree(WORLD, text)


def test_render_names_everything_a_user_checks_first():
    report = info.collect(MPI.COMM_SELF)
    text = info.render(report)
    for label in (
        "MPI library",
        "mpi4py",
        "CUDA-aware MPI",
        "CuPy",
        "CUDA",
        "NCCL",
        "ranks",
        "AUTO transport",
    ):
        assert label in text
    assert socket.gethostname() in text and "/job:worker/replica:0/task:0/device:" in text


def test_json_output(capsys):
    assert info.main(["--json"]) == 0
    out = capsys.readouterr().out
    if WORLD.Get_rank() == 0:
        assert json.loads(out)["size"] == WORLD.Get_size()
    else:
        assert out == ""


# -- as a command, under its own mpiexec ------------------------------------------------------


def child_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def mpiexec():
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def run(command, **env):
    done = subprocess.run(
        command, env=child_env(**env), capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.serial
def test_command_at_one_rank():
    out = run([sys.executable, "-m", "mpistrat", "info"])
    assert "CUDA-aware MPI" in out and "AUTO transport" in out and "host buffers: mpi" in out
    assert "/job:worker/replica:0/task:0/device:" in out


@pytest.mark.serial
def test_command_at_two_ranks_maps_every_rank():
    if mpiexec() is None:
        pytest.skip("no mpiexec")
    out = run(
        [mpiexec(), *launcher_options(), "-n", "2", sys.executable, "-m", "mpistrat", "info", "--json"],
        MPISTRAT_CUDA_AWARE="1",
    )
    report = json.loads(out)  # printed once, by rank 0
    assert report["size"] == 2 and [r["rank"] for r in report["ranks"]] == [0, 1]
    assert [r["local_rank"] for r in report["ranks"]] == [0, 1]  # both on this node
    assert report["ranks_per_node"] == {socket.gethostname(): 2}
    assert (
        report["cuda_aware"] is True
        and report["cuda_aware_how"] == "MPISTRAT_CUDA_AWARE=1 in the environment"
    )


@pytest.mark.serial
def test_command_warns_of_a_bad_setting_and_uses_the_default():
    done = subprocess.run(
        [sys.executable, "-m", "mpistrat", "info"],
        env=child_env(MPISTRAT_DEVICE="tpu"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "MPISTRAT_DEVICE='tpu' is not auto, gpu or cpu; using the default, auto" in done.stderr


@pytest.mark.serial
def test_numpy_work_with_device_cpu_never_imports_cupy():
    code = (
        "import sys, numpy, mpistrat; s = mpistrat.MPIStrategy(); "
        "s.run(lambda: mpistrat.get_replica_context().all_reduce('sum', numpy.ones(2))); "
        "print('cupy' in sys.modules, s.extended.worker_devices[0])"
    )
    out = run([sys.executable, "-c", code], MPISTRAT_DEVICE="cpu")
    assert out.split() == ["False", "/job:worker/replica:0/task:0/device:CPU:0"]
