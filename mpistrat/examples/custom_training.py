"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial, on mpistrat.

Run it with ``mpiexec -n 2 python -m mpistrat.examples.custom_training`` (any number of
ranks). The loop is the tutorial's, line for line: a distributed dataset, ``strategy.run``
of a train step that scales its loss with ``compute_average_loss``, ``strategy.reduce`` of
the per-replica losses, Keras-style metrics updated in each replica and read in
cross-replica context, a checkpoint every 2 epochs, and at the end a new model restored
from the latest checkpoint and evaluated without the strategy. Only the model differs: a
NumPy MLP (:mod:`mpistrat.examples.mlp`) whose gradients are written by hand where the
tutorial has a Keras model and a ``GradientTape``. The data are scikit-learn's bundled
8x8 digits (10 classes, like Fashion-MNIST's), so nothing is downloaded and it runs in
seconds.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

import mpistrat
from mpistrat import metrics
from mpistrat.examples import mlp
from mpistrat.examples.digits import load_digits

__all__ = ["main"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m mpistrat.examples.custom_training",
        description="The custom training loop of TensorFlow's distributed training tutorial, on MPI ranks.",
    )
    p.add_argument("--epochs", type=int, default=10, help="passes over the training set (10)")
    p.add_argument(
        "--batch-size-per-replica", type=int, default=64, help="examples per replica per step (64)"
    )
    p.add_argument("--checkpoint-dir", default="./training_checkpoints", help="(./training_checkpoints)")
    return p.parse_args(argv)


def sparse_categorical_crossentropy(labels: Any, logits: Any) -> Any:
    """Per-example loss, as ``tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
    reduction=NONE)``."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_probs[np.arange(len(labels)), labels]


def create_model() -> list[mpistrat.Variable]:
    """The model is its weights: 64 -> 64 (ReLU) -> 10, float32 (its layers are mlp's functions)."""
    sizes = [64, 64, 10]
    return [mpistrat.Variable(p) for p in mlp.init_params(sizes, np.random.default_rng(0), np.float32)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    train_images, train_labels, test_images, test_labels = (
        a.astype(np.float32) if a.dtype.kind == "f" else a for a in load_digits()
    )

    strategy = mpistrat.MPIStrategy()
    print_ = print if strategy.extended.rank == 0 else (lambda *a, **k: None)  # one rank prints
    print_(f"Number of devices: {strategy.num_replicas_in_sync}")

    BATCH_SIZE_PER_REPLICA = args.batch_size_per_replica
    GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    EPOCHS = args.epochs

    # tf.data's from_tensor_slices(...).shuffle(BUFFER_SIZE).batch(GLOBAL_BATCH_SIZE), whole-set shuffle
    train_dataset = mpistrat.ArrayDataset((train_images, train_labels), GLOBAL_BATCH_SIZE, shuffle=True)
    test_dataset = mpistrat.ArrayDataset((test_images, test_labels), GLOBAL_BATCH_SIZE)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    checkpoint_dir = args.checkpoint_dir

    with strategy.scope():
        # Set reduction to `NONE` so you can do the reduction yourself.
        loss_object = sparse_categorical_crossentropy

        def compute_loss(labels: Any, predictions: Any) -> Any:
            per_example_loss = loss_object(labels, predictions)
            return mpistrat.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)

    with strategy.scope():
        test_loss = metrics.Mean(name="test_loss")
        train_accuracy = metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = metrics.SparseCategoricalAccuracy(name="test_accuracy")

    # A model, an optimizer, and a checkpoint must be created under `strategy.scope`.
    with strategy.scope():
        model = create_model()
        optimizer = mpistrat.optimizers.Adam(learning_rate=0.001)
        checkpoint = mpistrat.Checkpoint(optimizer=optimizer, model=model)
        manager = mpistrat.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=3)

    def train_step(inputs: Any) -> Any:
        images, labels = inputs
        weights = [v.read_value() for v in model]
        predictions = mlp.logits(weights, images)
        loss = compute_loss(labels, predictions)
        # The GradientTape's work, by hand: the gradients of the summed loss, scaled as the loss is.
        _, grads = mlp.loss_and_grads(weights, images, labels)
        gradients = [g / GLOBAL_BATCH_SIZE for g in grads]
        optimizer.apply_gradients(zip(gradients, model, strict=True))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs: Any) -> None:
        images, labels = inputs
        predictions = mlp.logits([v.read_value() for v in model], images)
        t_loss = loss_object(labels, predictions)
        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    def distributed_train_step(dataset_inputs: Any) -> Any:
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(mpistrat.ReduceOp.SUM, per_replica_losses, axis=None)

    def distributed_test_step(dataset_inputs: Any) -> Any:
        return strategy.run(test_step, args=(dataset_inputs,))

    with strategy.scope():
        for epoch in range(EPOCHS):
            # TRAIN LOOP
            total_loss = 0.0
            num_batches = 0
            for x in train_dist_dataset:
                total_loss += distributed_train_step(x)
                num_batches += 1
            train_loss = total_loss / num_batches

            # TEST LOOP
            for x in test_dist_dataset:
                distributed_test_step(x)

            if epoch % 2 == 0:
                manager.save()

            template = "Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, Test Accuracy: {}"
            print_(
                template.format(
                    epoch + 1,
                    train_loss,
                    train_accuracy.result() * 100,
                    test_loss.result(),
                    test_accuracy.result() * 100,
                )
            )

            test_loss.reset_state()
            train_accuracy.reset_state()
            test_accuracy.reset_state()

    # Restore the latest checkpoint and test, without the strategy.
    eval_accuracy = metrics.SparseCategoricalAccuracy(name="eval_accuracy")

    new_model = create_model()
    new_optimizer = mpistrat.optimizers.Adam()

    test_dataset = mpistrat.ArrayDataset((test_images, test_labels), GLOBAL_BATCH_SIZE)

    def eval_step(images: Any, labels: Any) -> None:
        predictions = mlp.logits([v.read_value() for v in new_model], images)
        eval_accuracy(labels, predictions)

    checkpoint = mpistrat.Checkpoint(optimizer=new_optimizer, model=new_model)
    checkpoint.restore(mpistrat.latest_checkpoint(checkpoint_dir))

    for images, labels in test_dataset:
        eval_step(images, labels)

    print_(f"Accuracy after restoring the saved model without strategy: {eval_accuracy.result() * 100}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
