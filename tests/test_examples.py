"""The digits example: its backprop against finite differences, and the data-parallel claims.

The training runs spawn their own ``mpiexec``, so they run in the serial pass only.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpistrat.examples import mlp
from tests.support.launch import launcher_options

ROOT = Path(__file__).resolve().parent.parent
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


@pytest.mark.serial
def test_the_bundled_file_is_what_load_digits_returns():
    from sklearn.datasets import load_digits

    from mpistrat.examples.digits import bundled_digits

    x, y = bundled_digits()
    want_x, want_y = load_digits(return_X_y=True)
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_array_equal(y, want_y)


def run_example(ranks: int, tmp_path: Path, module: str, *options: str) -> str:
    """Run ``python -m module options`` under ``mpiexec -n ranks`` in ``tmp_path``; its output."""
    mpiexec = Path(sys.executable).with_name("mpiexec")
    mpiexec = str(mpiexec) if mpiexec.exists() else shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec next to the interpreter or on PATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    command = [mpiexec, *launcher_options(), "-n", str(ranks), sys.executable, "-m", module, *options]
    # A session of its own: no controlling terminal, as in a batch job, wherever the suite is run from.
    done = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, start_new_session=True
    )
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def train(ranks: int, tmp_path: Path, tag: str, *options: str) -> dict[str, np.ndarray]:
    """Run the digits example under ``mpiexec -n ranks``; the final weights and test accuracy."""
    out = tmp_path / f"{tag}.npz"
    run_example(
        ranks, tmp_path, "mpistrat.examples.digits", "--no-progress", "--weights-out", str(out), *options
    )
    with np.load(out) as weights:
        return dict(weights)


@pytest.mark.serial
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


@pytest.mark.serial
@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_sharded_optimizer_state_trains_the_same_model(tmp_path, optimizer):
    # Sharded slots at 3 ranks (uneven blocks) against the unsharded run at one rank.
    common = ("--epochs", "3", "--optimizer", optimizer, "--checkpoint-dir", "")
    whole = train(1, tmp_path, "whole", *common)
    sharded = train(3, tmp_path, "sharded", *common, "--shard-state")
    assert sharded.keys() == whole.keys()
    for name in whole:
        np.testing.assert_allclose(sharded[name], whole[name], rtol=1e-6, atol=1e-9, err_msg=name)
    assert whole["accuracy"] >= 0.9


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resuming_at_another_rank_count_continues_the_same_run(tmp_path):
    straight = train(2, tmp_path, "straight", "--epochs", "3", "--checkpoint-dir", "a")
    train(2, tmp_path, "first", "--epochs", "1", "--checkpoint-dir", "b")
    resumed = train(1, tmp_path, "resumed", "--epochs", "3", "--checkpoint-dir", "b", "--resume")
    for name in straight:
        np.testing.assert_allclose(resumed[name], straight[name], rtol=1e-6, atol=1e-9, err_msg=name)


@pytest.mark.serial
@pytest.mark.timeout(300)
def test_in_a_batch_log_progress_is_a_line_per_epoch_and_never_a_redrawn_bar(tmp_path):
    """Without a terminal (a Slurm log: this test's pipes, and no controlling terminal) rank 0 prints
    one line per epoch, with the epoch's steps, loss and accuracy; no carriage return, no bar."""
    out = run_example(2, tmp_path, "mpistrat.examples.digits", "--epochs", "2", "--checkpoint-dir", "")
    lines = [line for line in out.splitlines() if line.startswith("epoch ")]
    steps = -(-round(1797 * 0.8) // 64)  # the training split in global batches of 64
    pattern = rf"epoch [12]/2: {steps} steps, loss [\d.]+, acc [\d.]+, [\d.]+ s"
    assert len(lines) == 2 and all(re.fullmatch(pattern, line) for line in lines), out
    assert "\r" not in out and "it/s" not in out and "step/s" not in out, out


EPOCH_LINE = re.compile(
    r"^Epoch (\d+), Loss: ([\d.]+), Accuracy: ([\d.]+), Test Loss: ([\d.]+), Test Accuracy: ([\d.]+)$", re.M
)


@pytest.mark.serial
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_the_custom_training_tutorial_runs_saves_every_two_epochs_and_restores_the_latest(tmp_path, ranks):
    out = run_example(
        ranks, tmp_path, "mpistrat.examples.custom_training", "--epochs", "4", "--checkpoint-dir", "c"
    )
    epochs = {int(m[0]): [float(x) for x in m[1:]] for m in EPOCH_LINE.findall(out)}
    assert sorted(epochs) == [1, 2, 3, 4] and f"Number of devices: {ranks}" in out, out
    # Saved after epochs 1 and 3 (epoch % 2 == 0, counting from 0) as ckpt-1 and ckpt-2; the restore
    # without the strategy, on every rank over the whole test set, must see the epoch-3 weights: a local
    # metric over those gives the same accuracy as the distributed one summed over the ranks did then.
    assert sorted(os.listdir(tmp_path / "c")) == ["checkpoint", "ckpt-1", "ckpt-2"]
    restored = float(
        re.search(r"Accuracy after restoring the saved model without strategy: ([\d.]+)", out)[1]
    )
    assert restored == epochs[3][3], out
    # Test accuracy is a count over the 359 test images: a multiple of 100 / 359 (in float32).
    assert all(abs(e[3] * 359 / 100 - round(e[3] * 359 / 100)) < 1e-3 for e in epochs.values()), out
    assert epochs[4][0] < epochs[1][0] and epochs[4][3] > epochs[1][3], out  # it learns


MW_EPOCH = re.compile(r"^Epoch: (\d+), accuracy: ([\d.]+), train_loss: ([\d.]+)\.$", re.M)


@pytest.mark.serial
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_the_multi_worker_tutorial_saves_on_the_chief_and_resumes_after_a_restart(tmp_path, ranks):
    module = "mpistrat.examples.multi_worker"
    out = run_example(ranks, tmp_path, module, "--epochs", "2", "--checkpoint-dir", "ckpt")
    first = {int(m[0]): float(m[2]) for m in MW_EPOCH.findall(out)}
    assert sorted(first) == [0, 1] and first[1] < first[0], out  # it learns
    # The chief alone wrote (max_to_keep=1 keeps the second save); each other worker's temporary
    # directory was created by its manager's save and emptied by the tutorial's rmtree.
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["checkpoint", "ckpt-2"]
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("workertemp_")) == [
        f"workertemp_{i}" for i in range(1, ranks)
    ]
    assert all(not os.listdir(tmp_path / f"workertemp_{i}") for i in range(1, ranks))
    # A restart with more epochs restores the latest checkpoint and trains only what is left.
    out = run_example(ranks, tmp_path, module, "--epochs", "3", "--checkpoint-dir", "ckpt")
    assert "Restored ckpt-2 at epoch 2" in out and [int(m[0]) for m in MW_EPOCH.findall(out)] == [2], out
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["checkpoint", "ckpt-3"]
