"""TensorFlow's "Custom training loop with Keras and MultiWorkerMirroredStrategy" tutorial, on mpistrat.

Run it with ``mpiexec -n 2 python -m mpistrat.examples.multi_worker`` (any number of ranks),
or ``srun -n 2 python -m mpistrat.examples.multi_worker --slurm`` under Slurm, where the
strategy is given a ``SlurmClusterResolver`` that reads the job step's environment.

:func:`main` is the tutorial's ``main.py`` ported line by line (docs/migrating.md shows the lines
that changed, and ``tests/test_migrating.py`` checks that its port is this code): the command line
sets the tutorial's constants (batch size, epochs, steps, the checkpoint directory) and a line
says what a restart restored. The tutorial's ``mnist.py`` (its model and data) is the rest of this
module: a NumPy MLP (:mod:`mpistrat.examples.mlp`) with hand-written gradients where the tutorial
has a Keras CNN and a ``GradientTape``, and scikit-learn's bundled 8x8 digits where it downloads
MNIST, so that it runs anywhere in seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

import numpy as np

import mpistrat
from mpistrat.examples import mlp
from mpistrat.examples.digits import load_digits

__all__ = ["Model", "build_cnn_model", "dataset_fn", "main"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m mpistrat.examples.multi_worker",
        description="The multi-worker custom training loop of TensorFlow's tutorial, on MPI ranks.",
    )
    p.add_argument("--epochs", type=int, default=3, help="train until this many epochs are done (3)")
    p.add_argument("--steps-per-epoch", type=int, default=20, help="(20)")
    p.add_argument("--per-worker-batch-size", type=int, default=32, help="(32)")
    p.add_argument("--checkpoint-dir", default="./ckpt", help="the chief's checkpoint directory (./ckpt)")
    p.add_argument("--slurm", action="store_true", help="pass a SlurmClusterResolver (under srun)")
    return p.parse_args(argv)


# -- the tutorial's mnist.py, for NumPy ------------------------------------------------------------


class ShardedBatches:
    """``dataset.shard(num_input_pipelines, input_pipeline_id).batch(batch_size).repeat()``: every
    pass over it starts at the shard's beginning, as re-creating a tf.data iterator does."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int):
        self.x, self.y, self.batch_size = x, y, batch_size

    def __iter__(self) -> Any:
        while True:
            for start in range(0, len(self.x) - self.batch_size + 1, self.batch_size):
                yield self.x[start : start + self.batch_size], self.y[start : start + self.batch_size]


def mnist_dataset() -> tuple[np.ndarray, np.ndarray]:
    """The tutorial's ``mnist_dataset()``: the training images scaled to [0, 1], shuffled once."""
    x_train, y_train, _, _ = load_digits()
    order = np.random.default_rng(0).permutation(len(x_train))
    return x_train[order].astype(np.float32), y_train[order].astype(np.int64)


def dataset_fn(global_batch_size: int, input_context: mpistrat.InputContext) -> ShardedBatches:
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    x, y = mnist_dataset()
    n, i = input_context.num_input_pipelines, input_context.input_pipeline_id
    return ShardedBatches(x[i::n], y[i::n], batch_size)


class Model:
    """What the tutorial's Keras model gives its loop: ``model(x, training=...)`` (the logits) and
    ``trainable_variables``, and, since NumPy has no autodiff, ``loss_and_gradients(x, y)``: the
    per-example losses and the gradients of their sum. A 64 -> 64 (ReLU) -> 10 MLP, float32."""

    def __init__(self) -> None:
        params = mlp.init_params([64, 64, 10], np.random.default_rng(0), np.float32)
        self.trainable_variables = [mpistrat.Variable(p) for p in params]

    def __call__(self, x: Any, training: bool = False) -> Any:
        return mlp.logits([v.read_value() for v in self.trainable_variables], x)

    def loss_and_gradients(self, x: Any, y: Any) -> tuple[Any, list[Any]]:
        return mlp.loss_and_grads([v.read_value() for v in self.trainable_variables], x, y)


def build_cnn_model() -> Model:
    """The tutorial's name for its model builder; the model here is the MLP above."""
    return Model()


# -- the tutorial's main.py ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mnist = sys.modules[__name__]  # the tutorial's `import mnist`: the functions above

    per_worker_batch_size = args.per_worker_batch_size
    resolver = mpistrat.cluster_resolver.SlurmClusterResolver() if args.slurm else None
    strategy = mpistrat.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    num_workers = strategy.num_replicas_in_sync
    global_batch_size = per_worker_batch_size * num_workers

    num_epochs = args.epochs
    num_steps_per_epoch = args.steps_per_epoch

    # Checkpoint saving and restoring
    def _is_chief(task_type, task_id, cluster_spec):  # the tutorial's helpers, as they are
        return (
            task_type is None
            or task_type == "chief"
            or (task_type == "worker" and task_id == 0 and "chief" not in cluster_spec.as_dict())
        )

    def _get_temp_dir(dirpath, task_id):
        base_dirpath = "workertemp_" + str(task_id)
        temp_dir = os.path.join(dirpath, base_dirpath)
        os.makedirs(temp_dir, exist_ok=True)
        return temp_dir

    def write_filepath(filepath, task_type, task_id, cluster_spec):
        dirpath = os.path.dirname(filepath)
        base = os.path.basename(filepath)
        if not _is_chief(task_type, task_id, cluster_spec):
            dirpath = _get_temp_dir(dirpath, task_id)
        return os.path.join(dirpath, base)

    checkpoint_dir = os.path.abspath(args.checkpoint_dir)

    with strategy.scope():
        # Model building/compiling need to be within `strategy.scope()`.
        multi_worker_model = mnist.build_cnn_model()

        multi_worker_dataset = strategy.distribute_datasets_from_function(
            lambda input_context: mnist.dataset_fn(global_batch_size, input_context)
        )
        optimizer = mpistrat.optimizers.Adam(learning_rate=0.001)
        train_accuracy = mpistrat.metrics.SparseCategoricalAccuracy(name="train_accuracy")

    def train_step(iterator):
        """Training step function."""

        def step_fn(inputs):
            """Per-Replica step function."""
            x, y = inputs
            predictions = multi_worker_model(x, training=True)
            per_batch_loss, grads = multi_worker_model.loss_and_gradients(x, y)
            loss = mpistrat.compute_average_loss(per_batch_loss, global_batch_size=global_batch_size)
            grads = [g / global_batch_size for g in grads]
            optimizer.apply_gradients(zip(grads, multi_worker_model.trainable_variables))  # noqa: B905
            train_accuracy.update_state(y, predictions)

            return loss

        per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(mpistrat.ReduceOp.SUM, per_replica_losses, axis=None)

    epoch = mpistrat.Variable(initial_value=np.int64(0), name="epoch")
    step_in_epoch = mpistrat.Variable(initial_value=np.int64(0), name="step_in_epoch")

    task_type, task_id, cluster_spec = (
        strategy.cluster_resolver.task_type,
        strategy.cluster_resolver.task_id,
        strategy.cluster_resolver.cluster_spec(),
    )

    checkpoint = mpistrat.Checkpoint(model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch)

    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id, cluster_spec)
    checkpoint_manager = mpistrat.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)

    # Restoring the checkpoint
    latest_checkpoint = mpistrat.latest_checkpoint(checkpoint_dir)
    if latest_checkpoint:
        checkpoint.restore(latest_checkpoint)
        if task_id == 0:
            print(f"Restored {os.path.basename(latest_checkpoint)} at epoch {int(epoch.numpy())}", flush=True)

    # Resume our CTL training
    while epoch.numpy() < num_epochs:
        iterator = iter(multi_worker_dataset)
        total_loss = 0.0
        num_batches = 0

        while step_in_epoch.numpy() < num_steps_per_epoch:
            total_loss += train_step(iterator)
            num_batches += 1
            step_in_epoch.assign_add(1)

        train_loss = total_loss / num_batches
        accuracy = train_accuracy.result()  # collective: every rank reads it, the chief prints it
        if task_id == 0:
            print(
                "Epoch: %d, accuracy: %f, train_loss: %f."  # noqa: UP031 (the tutorial's line)
                % (epoch.numpy(), accuracy, train_loss)
            )

        train_accuracy.reset_states()

        epoch.assign_add(1)
        step_in_epoch.assign(0)
        checkpoint_manager.save()
        if not _is_chief(task_type, task_id, cluster_spec):
            shutil.rmtree(write_checkpoint_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
