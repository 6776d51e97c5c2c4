"""Train a digits classifier data-parallel over MPI ranks, the tf.distribute way.

Run it with ``mpiexec -n 2 python -m mpistrat.examples.digits`` (any number of ranks;
``python -m mpistrat.examples.digits`` alone is one replica). The data is scikit-learn's
bundled handwritten-digits set (1,797 8x8 images), so nothing is downloaded.

Every rank runs this program. Each step takes one shuffled global batch;
``experimental_distribute_dataset`` hands every rank its slice of it; ``strategy.run``
computes the slice's loss and gradients; ``optimizer.apply_gradients`` sums the gradients
across ranks (one fused all-reduce) and applies the same update to every rank's copy of the
mirrored variables. The global batch and its mean gradient do not depend on the number of
ranks, so 1, 2 or 4 ranks train the same model (up to float rounding).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import numpy as np

import mpistrat
from mpistrat.examples import mlp
from mpistrat.log import from_terminal

__all__ = ["bundled_digits", "load_digits", "main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command-line options (``--help`` lists them)."""
    p = argparse.ArgumentParser(
        prog="python -m mpistrat.examples.digits",
        description="Train an MLP on the handwritten digits, data-parallel over MPI ranks.",
    )
    p.add_argument("--epochs", type=int, default=20, help="passes over the training set (default 20)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch size, over all ranks (64)")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam", help="adam (default) or sgd")
    p.add_argument("--learning-rate", "--lr", type=float, default=None, help="default 0.005 adam, 0.1 sgd")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (0.9)")
    p.add_argument(
        "--shard-state",
        action="store_true",
        help="each rank holds 1/N of the optimizer's slots (ZeRO stage 1); same results",
    )
    p.add_argument(
        "--hidden", type=int, nargs="*", default=[64], metavar="N", help="hidden layer sizes (default: 64)"
    )
    p.add_argument("--seed", type=int, default=0, help="initial weights and shuffling (0)")
    p.add_argument(
        "--checkpoint-dir",
        default="digits-checkpoints",
        help="where the checkpoint is saved after every epoch (digits-checkpoints); '' for none",
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument(
        "--preemptible",
        action="store_true",
        help="on SIGTERM/SIGUSR1 save mid-epoch and exit (requeue under Slurm); resumes by itself",
    )
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="NumPy (cpu) or CuPy (gpu)")
    p.add_argument("--weights-out", default=None, metavar="PATH", help="save the final weights (.npz)")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress: neither the bar (from a terminal) nor the line per epoch (in a batch log)",
    )
    args = p.parse_args(argv)
    if args.learning_rate is None:
        args.learning_rate = 0.005 if args.optimizer == "adam" else 0.1
    if args.epochs < 0 or args.batch_size < 1:
        p.error("--epochs must be >= 0 and --batch-size >= 1")
    if args.preemptible and not args.checkpoint_dir:
        p.error("--preemptible needs a --checkpoint-dir")
    return args


def bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: 1,797 rows of 64 pixel values (0 to 16), and their labels.

    Read straight from the file scikit-learn ships, where it keeps it: importing scikit-learn
    takes seconds in every rank. ``sklearn.datasets.load_digits`` is the fallback.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        _missing("the digits example needs scikit-learn: pip install '.[examples]' in the clone")
    for root in spec.submodule_search_locations or []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1], data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sklearn_digits

    return sklearn_digits(return_X_y=True)


def load_digits(test_fraction: float = 0.2) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``x_train, y_train, x_test, y_test``: pixels scaled to [0, 1], a fixed held-out split.

    The split does not depend on ``--seed``, so runs with different seeds are scored on the
    same test images.
    """
    x, y = bundled_digits()
    order = np.random.default_rng(12345).permutation(len(y))
    x, y = (x[order] / 16.0), y[order].astype(np.int64)
    n_test = round(len(y) * test_fraction)
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def global_batches(
    x: Any, y: Any, batch_size: int, rng: np.random.Generator | None
) -> Iterator[tuple[Any, Any]]:
    """``(x, y)`` global batches in a shuffled order (``rng``) or in order (``None``)."""
    order = np.arange(len(y)) if rng is None else rng.permutation(len(y))
    xp = mlp.array_module(x)  # the order is drawn with NumPy on every device, so runs agree
    for start in range(0, len(y), batch_size):
        idx = xp.asarray(order[start : start + batch_size])
        yield x[idx], y[idx]


def _array_module(device: str) -> ModuleType:
    if device == "cpu":
        return np
    try:
        import cupy
    except ImportError:
        _missing("--device gpu needs CuPy: pip install '.[cuda]' in the clone")
    return cupy


def _missing(message: str) -> NoReturn:
    """Exit 1 on every rank, saying why once (rank 0), on a line of its own."""
    raise SystemExit(message if mpistrat.MPI.COMM_WORLD.Get_rank() == 0 else 1)


def _epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    # The shuffle of epoch e depends only on (seed, e): a resumed run sees the same batches.
    return np.random.default_rng([seed, epoch])


class _NoBar:
    """No progress: --no-progress, or a rank other than 0."""

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class _EpochLine(_NoBar):
    """Progress as one line per epoch, where nobody watches a bar (a batch log) or tqdm is missing."""

    def __init__(self, desc: str):
        self.desc, self.steps, self.start = desc, 0, time.perf_counter()
        self.postfix: dict[str, Any] = {}

    def set_postfix(self, refresh: bool = True, **kwargs: Any) -> None:
        self.postfix = kwargs

    def update(self, n: int = 1) -> None:
        self.steps += n

    def close(self) -> None:
        said = "".join(f", {k} {v}" for k, v in self.postfix.items())
        print(f"{self.desc}: {self.steps} steps{said}, {time.perf_counter() - self.start:.2f} s", flush=True)


def _progress(total: int, desc: str, enabled: bool) -> Any:
    """tqdm's bar where a person watches (from a terminal) and tqdm is installed, else a line per epoch."""
    if not enabled:
        return _NoBar()
    if from_terminal():
        try:
            from tqdm import tqdm
        except ImportError:  # optional: the run is the same without a bar
            pass
        else:
            return tqdm(total=total, desc=desc, unit="step", leave=True, file=sys.stdout)
    return _EpochLine(desc)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    xp = _array_module(args.device)
    strategy = mpistrat.MPIStrategy()
    rank, n_ranks = strategy.extended.rank, strategy.num_replicas_in_sync
    say = print if rank == 0 else (lambda *a, **k: None)

    x_train, y_train, x_test, y_test = (xp.asarray(a) for a in load_digits())
    sizes = [x_train.shape[1], *args.hidden, 10]

    with strategy.scope():
        # Mirrored variables start from rank 0's draw, so every rank holds the same weights.
        init = mlp.init_params(sizes, np.random.default_rng(args.seed))
        names = [f"{kind}{i // 2 + 1}" for i, kind in enumerate(["w", "b"] * (len(init) // 2))]
        params = [mpistrat.Variable(xp.asarray(p), name=n) for n, p in zip(names, init, strict=True)]
        optimizer: mpistrat.optimizers.Optimizer
        if args.optimizer == "adam":
            optimizer = mpistrat.optimizers.Adam(args.learning_rate, shard_state=args.shard_state)
        else:
            optimizer = mpistrat.optimizers.SGD(
                args.learning_rate, momentum=args.momentum, shard_state=args.shard_state
            )
        epoch = mpistrat.Variable(np.int64(0), trainable=False, name="epoch")

    checkpoint = mpistrat.Checkpoint(
        optimizer=optimizer, epoch=epoch, **dict(zip(names, params, strict=True))
    )
    manager = None
    if args.checkpoint_dir:  # numbered files ckpt-<epoch>, of which the two newest are kept
        manager = mpistrat.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=2)
    handler = None
    if args.preemptible and manager is not None:
        # Restores the newest checkpoint (an epoch's end, or the step a preempted run stopped at).
        handler = mpistrat.PreemptionCheckpointHandler(manager)
    elif args.resume and manager is not None:
        path = manager.latest_checkpoint
        if path is None:
            say(f"no checkpoint in {args.checkpoint_dir}: starting from scratch")
        else:
            checkpoint.restore(path).assert_consumed()
            say(f"resumed from {path} (epoch {int(epoch.numpy())})")

    def train_step(x: Any, y: Any, global_batch: int) -> tuple[Any, Any]:
        weights = [v.read_value() for v in params]
        per_example_loss, grads = mlp.loss_and_grads(weights, x, y)
        correct = (mlp.predict(weights, x) == y).sum()
        del weights  # nothing holds the values during the step, so it updates them in place
        # Each replica's share of the global-batch mean; apply_gradients sums the shares.
        loss = mpistrat.compute_average_loss(per_example_loss, global_batch_size=global_batch)
        optimizer.apply_gradients(zip([g / global_batch for g in grads], params, strict=True))
        return loss, correct

    def eval_step(x: Any, y: Any) -> Any:
        return (mlp.predict([v.read_value() for v in params], x) == y).sum()

    train_time, steps, seen = 0.0, 0, 0
    steps_per_epoch = -(-len(y_train) // args.batch_size)
    done_steps = handler.total_run_calls if handler is not None else int(epoch.numpy()) * steps_per_epoch
    for e in range(done_steps // steps_per_epoch, args.epochs):
        batches = list(global_batches(x_train, y_train, args.batch_size, _epoch_rng(args.seed, e)))
        if e == done_steps // steps_per_epoch:  # a preempted run stopped mid-epoch: skip what it did
            batches = batches[done_steps % steps_per_epoch :]
        bar = _progress(len(batches), f"epoch {e + 1}/{args.epochs}", rank == 0 and not args.no_progress)
        loss_sum, correct_sum, count = 0.0, 0, 0
        start = time.perf_counter()
        dist_batches = strategy.experimental_distribute_dataset(batches)
        for (x, y), (_, y_global) in zip(dist_batches, batches, strict=True):
            n = len(y_global)
            if handler is not None:  # checks for a stop agreed in earlier steps, then runs this one
                per_replica = handler.run(strategy.run, train_step, args=(x, y, n))
            else:
                per_replica = strategy.run(train_step, args=(x, y, n))
            loss, correct = strategy.reduce("sum", per_replica)
            loss_sum, correct_sum, count = loss_sum + float(loss) * n, correct_sum + int(correct), count + n
            bar.set_postfix(loss=f"{loss_sum / count:.4f}", acc=f"{correct_sum / count:.4f}", refresh=False)
            bar.update()
        train_time += time.perf_counter() - start
        steps, seen = steps + len(batches), seen + count
        bar.close()
        with strategy.scope():
            epoch.assign(np.int64(e + 1))
        if manager is not None:
            # Written atomically: a job killed mid-save still has the previous epoch's.
            manager.save(checkpoint_number=epoch)

    correct = 0
    for x, y in strategy.experimental_distribute_dataset(list(global_batches(x_test, y_test, 256, None))):
        correct += int(strategy.reduce("sum", strategy.run(eval_step, args=(x, y))))
    accuracy = correct / len(y_test)
    done = int(epoch.numpy())
    say(f"test accuracy {accuracy:.4f} ({correct}/{len(y_test)}) after {done} epoch{'s' * (done != 1)}")
    if steps:
        say(
            f"{seen / train_time:,.0f} examples/s, {1e3 * train_time / steps:.2f} ms/step "
            f"({n_ranks} rank{'s' * (n_ranks > 1)}, global batch {args.batch_size}, {args.device})"
        )
    if args.weights_out and rank == 0:
        # Any: numpy's stub would match a **dict of arrays against savez's allow_pickle: bool.
        arrays: dict[str, Any] = {n: _to_numpy(v.read_value()) for n, v in zip(names, params, strict=True)}
        np.savez(args.weights_out, accuracy=accuracy, **arrays)
    return 0


def _to_numpy(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


if __name__ == "__main__":
    sys.exit(main())
