"""compute_average_loss over uneven pipelines: the sum over replicas is the serial mean of the step.

The reference is a serial NumPy loop over the same data: at step s the global batch
is every rank's s-th batch (nothing for a pipeline that has ended), and the loss and
gradient are plain means over it.
"""

import numpy as np

import mpistrat
from mpistrat import ContextError, InvalidArgumentError
from tests.conftest import all_ranks_agree, raises_on_every_rank

TRUE_W = np.array([2.0, -1.0, 0.5])


def examples(rank):
    """Rank r holds 3 + 2r examples (pipelines of different lengths at every rank count)."""
    rng = np.random.default_rng(100 + rank)
    x = rng.normal(size=(3 + 2 * rank, 3))
    return x, x @ TRUE_W + rng.normal(scale=0.1, size=len(x))


def batches(rank, batch=2):
    x, y = examples(rank)
    return [{"x": x[i : i + batch], "y": y[i : i + batch]} for i in range(0, len(x), batch)]


def serial_training(size, steps_lr=0.1):
    """The same training loop, serially: returns the per-step losses and the final weights."""
    per_rank = [batches(r) for r in range(size)]
    w, losses = np.zeros(3), []
    for s in range(max(len(b) for b in per_rank)):
        step = [b[s] for b in per_rank if s < len(b)]
        x = np.concatenate([b["x"] for b in step])
        y = np.concatenate([b["y"] for b in step])
        err = x @ w - y
        losses.append(np.mean(err**2))
        w = w - steps_lr * np.mean(2 * err[:, None] * x, axis=0)
    return losses, w


def test_training_over_uneven_pipelines_matches_the_serial_mean(group):
    strategy = group.strategy
    dist = strategy.distribute_datasets_from_function(lambda ctx: batches(ctx.input_pipeline_id))
    w, losses = np.zeros(3), []

    def step(batch, w):
        ctx = mpistrat.get_replica_context()
        err = batch["x"] @ w - batch["y"]
        loss = mpistrat.compute_average_loss(err**2)  # counts the step's examples itself
        count = int(ctx.all_reduce("sum", len(err)))
        per_example = 2 * err[:, None] * batch["x"]
        grad = [mpistrat.compute_average_loss(per_example[:, j], global_batch_size=count) for j in range(3)]
        return ctx.all_reduce("sum", (loss, np.array(grad)))

    for batch in dist:
        loss, grad = strategy.run(step, args=(batch, w))
        losses.append(float(loss))
        w = w - 0.1 * grad
    want_losses, want_w = serial_training(group.size)
    ok = len(losses) == len(want_losses) and np.allclose(losses, want_losses) and np.allclose(w, want_w)
    all_ranks_agree(group.comm, ok, f"{losses} vs {want_losses}; {w} vs {want_w}")


def test_explicit_global_batch_size_and_weights(group):
    def step():
        r = mpistrat.get_replica_context().replica_id_in_sync_group
        loss = np.full(r + 1, float(r + 1))  # replica r: r + 1 examples of loss r + 1
        weight = np.full(r + 1, 0.5)
        return (
            mpistrat.compute_average_loss(loss, global_batch_size=10),
            mpistrat.compute_average_loss(loss, sample_weight=weight),
        )

    plain, weighted = group.strategy.run(step)
    r = group.rank
    n = group.size * (group.size + 1) // 2
    ok = np.isclose(plain, (r + 1) ** 2 / 10) and np.isclose(weighted, 0.5 * (r + 1) ** 2 / n)
    all_ranks_agree(group.comm, ok and plain.dtype == np.float64, f"{plain} {weighted}")


def test_empty_batches_everywhere_give_zero(group):
    got = group.strategy.run(lambda: mpistrat.compute_average_loss(np.empty(0, np.float32)))
    all_ranks_agree(group.comm, got == 0 and got.dtype == np.float32, f"{got!r}")


def test_integer_losses_become_float64_outside_any_strategy():
    got = mpistrat.compute_average_loss(np.array([1, 2]))
    assert got == 1.5 and got.dtype == np.float64


def test_refusals(group):
    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: group.strategy.run(lambda: mpistrat.compute_average_loss(np.float64(2.0))),
        "leading batch dimension",
    )
    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: mpistrat.compute_average_loss(np.ones(2), global_batch_size=-1),
        "global_batch_size",
    )

    def merge_fn(strategy):
        return mpistrat.compute_average_loss(np.ones(2))

    raises_on_every_rank(
        group.comm,
        ContextError,
        lambda: group.strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn)),
        "merge_fn",
    )


def test_cross_replica_context_needs_global_batch_size_as_in_tf(group):
    # tf.nn.compute_average_loss in cross-replica context: RuntimeError ("You are calling
    # `compute_average_loss` in cross replica context") without global_batch_size; with it,
    # sum / global_batch_size (tf gives 0.75 for [1.0, 2.0] and 4 at 1, 2 and 3 replicas).
    raises_on_every_rank(
        group.comm,
        RuntimeError,
        lambda: _in_scope(group, lambda: mpistrat.compute_average_loss(np.ones(3))),
        "cross replica context",
    )
    got = _in_scope(group, lambda: mpistrat.compute_average_loss(np.array([1.0, 2.0]), global_batch_size=4))
    all_ranks_agree(group.comm, got == 0.75, f"{got}")


def _in_scope(group, fn):
    with group.strategy.scope():
        return fn()
