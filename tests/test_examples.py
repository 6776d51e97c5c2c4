"""The digits example: its backprop against finite differences, and the data-parallel claims.

The training runs spawn their own ``mpiexec``, so they run in the serial pass only.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpistrat.examples import mlp
from tests.launch import launcher_options

ROOT = Path(__file__).resolve().parent.parent
SERIAL_ONLY = pytest.mark.skipif(
    MPI.COMM_WORLD.Get_size() > 1, reason="spawns its own mpiexec: runs in the serial pass only"
)
# Launcher variables of an enclosing MPI job would make the child join it instead of starting its own.
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_", "MPI_LOCAL", "MPIR_", "I_MPI_", "SLURM_")


def test_backprop_matches_finite_differences():
    rng = np.random.default_rng(1)
    params = mlp.init_params([6, 5, 4, 3], rng)
    x, labels = rng.standard_normal((7, 6)), rng.integers(0, 3, 7)
    _, grads = mlp.loss_and_grads(params, x, labels)
    eps = 1e-6
    for k, p in enumerate(params):
        numeric = np.zeros_like(p)
        for i in np.ndindex(p.shape):
            shifted = [q.copy() for q in params]
            shifted[k][i] += eps
            up = mlp.loss_and_grads(shifted, x, labels)[0].sum()
            shifted[k][i] -= 2 * eps
            down = mlp.loss_and_grads(shifted, x, labels)[0].sum()
            numeric[i] = (up - down) / (2 * eps)
        np.testing.assert_allclose(grads[k], numeric, atol=1e-7, err_msg=f"parameter {k}")


def test_an_empty_batch_gives_zero_loss_and_gradients():
    params = mlp.init_params([4, 3, 2], np.random.default_rng(0))
    losses, grads = mlp.loss_and_grads(params, np.zeros((0, 4)), np.zeros(0, dtype=np.int64))
    assert losses.shape == (0,)
    assert all(g.shape == p.shape and not g.any() for g, p in zip(grads, params, strict=True))


@SERIAL_ONLY
def test_the_bundled_file_is_what_load_digits_returns():
    from sklearn.datasets import load_digits

    from mpistrat.examples.digits import bundled_digits

    x, y = bundled_digits()
    want_x, want_y = load_digits(return_X_y=True)
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_array_equal(y, want_y)


def train(ranks: int, tmp_path: Path, tag: str, *options: str) -> dict[str, np.ndarray]:
    """Run the example under ``mpiexec -n ranks``; the final weights and test accuracy."""
    mpiexec = Path(sys.executable).with_name("mpiexec")
    mpiexec = str(mpiexec) if mpiexec.exists() else shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec next to the interpreter or on PATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / f"{tag}.npz"
    command = [mpiexec, *launcher_options(), "-n", str(ranks)]
    command += [sys.executable, "-m", "mpistrat.examples.digits", "--no-progress"]
    command += ["--weights-out", str(out), *options]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    with np.load(out) as weights:
        return dict(weights)


@SERIAL_ONLY
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_two_and_four_ranks_train_the_same_model(tmp_path):
    # The defaults, as `make demo` runs them: same seed and global batch at every rank count.
    runs = {n: train(n, tmp_path, f"n{n}", "--checkpoint-dir", f"ckpt{n}") for n in (1, 2, 4)}
    for n in (2, 4):
        assert runs[n].keys() == runs[1].keys()
        for name in runs[1]:
            np.testing.assert_allclose(runs[n][name], runs[1][name], rtol=1e-6, atol=1e-9, err_msg=name)
    assert runs[1]["accuracy"] >= 0.95


@SERIAL_ONLY
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resuming_at_another_rank_count_continues_the_same_run(tmp_path):
    straight = train(2, tmp_path, "straight", "--epochs", "3", "--checkpoint-dir", "a")
    train(2, tmp_path, "first", "--epochs", "1", "--checkpoint-dir", "b")
    resumed = train(1, tmp_path, "resumed", "--epochs", "3", "--checkpoint-dir", "b", "--resume")
    for name in straight:
        np.testing.assert_allclose(resumed[name], straight[name], rtol=1e-6, atol=1e-9, err_msg=name)
