"""Metrics: every replica's updates aggregated, against NumPy over the concatenated data and tf's values."""

import numpy as np
import pytest

import mpistrat
from mpistrat import ContextError, InvalidArgumentError
from mpistrat.metrics import Accuracy, CategoricalAccuracy, Mean, SparseCategoricalAccuracy, Sum
from tests.conftest import all_ranks_agree, raises_on_every_rank

STEPS, CLASSES = 4, 5


def global_batches(seed=0):
    """Per step: values of shape (B, 3), weights (B,), labels (B,), scores (B, CLASSES); float32."""
    rng = np.random.default_rng(seed)
    for step in range(STEPS):
        size = 7 + 5 * step
        scores = rng.standard_normal((size, CLASSES)).astype(np.float32)
        labels = rng.integers(0, CLASSES, size)
        labels[: size // 2] = scores[: size // 2].argmax(axis=1)  # about half right
        yield (
            rng.standard_normal((size, 3)).astype(np.float32),
            rng.uniform(0.0, 2.0, size).astype(np.float32),
            labels,
            scores,
        )


def my_rows(group, size, step):
    """This rank's slice of a global batch: uneven, and some rank gets none at some step."""
    shares = np.array([(r + step) % 3 for r in range(group.size)], dtype=float) + 0.5 * (group.size == 1)
    bounds = np.round(np.concatenate([[0], np.cumsum(shares)]) / shares.sum() * size).astype(int)
    return slice(bounds[group.rank], bounds[group.rank + 1])


def run_metrics(group, with_weights):
    with group.strategy.scope():
        metrics = {
            "mean": Mean(),
            "sum": Sum(),
            "accuracy": Accuracy(),
            "sparse": SparseCategoricalAccuracy(),
            "categorical": CategoricalAccuracy(),
        }

    def step(values, weights, labels, scores):
        w = weights if with_weights else None
        metrics["mean"].update_state(values, sample_weight=w)
        metrics["sum"].update_state(values, sample_weight=w)
        metrics["accuracy"].update_state(labels, scores.argmax(axis=1).astype(np.float32), sample_weight=w)
        metrics["sparse"].update_state(labels, scores, sample_weight=w)
        one_hot = np.eye(CLASSES, dtype=np.float32)[labels]
        metrics["categorical"].update_state(one_hot, scores, sample_weight=w)

    for k, batch in enumerate(global_batches()):
        rows = my_rows(group, len(batch[0]), k)
        group.strategy.run(step, args=tuple(a[rows] for a in batch))
    with group.strategy.scope():
        return {name: m.result() for name, m in metrics.items()}


def numpy_reference(with_weights):
    """The same metrics, serially over the concatenated global batches (float64)."""
    values, weights, labels, scores = (np.concatenate(parts) for parts in zip(*global_batches(), strict=True))
    w = weights.astype(np.float64) if with_weights else np.ones(len(labels))
    per_example_mean, per_example_sum = values.mean(axis=1), values.sum(axis=1)
    right = (scores.argmax(axis=1) == labels).astype(np.float64)
    accuracy = (right * w).sum() / w.sum()
    return {
        "mean": (per_example_mean * w).sum() / w.sum(),
        "sum": (per_example_sum * w).sum(),
        "accuracy": accuracy,
        "sparse": accuracy,
        "categorical": accuracy,
    }


@pytest.mark.parametrize("with_weights", [False, True])
def test_results_aggregate_every_replica_as_one_serial_metric(group, with_weights):
    got = run_metrics(group, with_weights)
    want = numpy_reference(with_weights)
    ok = all(
        got[k].dtype == np.float32
        and got[k].shape == ()
        and np.isclose(got[k], want[k], rtol=2e-6, atol=1e-6)
        for k in want
    )
    all_ranks_agree(group.comm, ok, f"{ {k: float(v) for k, v in got.items()} } != {want}")


# What tf.keras.metrics (Keras 3.15 in TensorFlow 2.21) gives for each case; (y_true, y_pred, weight).
KERAS_CASES = [
    # Mean of rank-2 values: averaged per example first, so the count is the number of rows.
    (Mean, ([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]],), None, 3.5, [7.0, 2.0]),
    (Mean, ([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]],), [1.0, 0.5], 3.0, [4.5, 1.5]),
    (Mean, ([[1.0, 2.0], [3.0, 4.0]],), [[1.0, 0.0], [1.0, 1.0]], 2.6666667, [4.0, 1.5]),
    (Mean, ([1.0, 2.0, 3.0],), [1.0, 0.0, 2.0], 2.3333333, [7.0, 3.0]),
    (Mean, (5.0,), None, 5.0, [5.0, 1.0]),
    (Mean, (np.zeros(0),), None, 0.0, [0.0, 0.0]),  # divide_no_nan: 0 before any example
    (Sum, ([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]],), [1.0, 0.5], 13.5, [13.5]),
    (Accuracy, ([[1], [2], [3], [4]], [[0], [2], [3], [4]]), None, 0.75, [3.0, 4.0]),
    (Accuracy, ([1, 2, 3, 4], [1.0, 2.0, 3.5, 4.0]), [1.0, 1.0, 0.0, 2.0], 1.0, [4.0, 4.0]),
    (SparseCategoricalAccuracy, ([[2], [1]], [[0.1, 0.6, 0.3], [0.05, 0.95, 0.0]]), None, 0.5, [1.0, 2.0]),
    (SparseCategoricalAccuracy, ([2, 1], [[0.1, 0.6, 0.3], [0.05, 0.95, 0.0]]), [0.7, 0.3], 0.3, [0.3, 1.0]),
    (
        SparseCategoricalAccuracy,
        ([0, 1], [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]),
        None,
        0.5,
        [1.0, 2.0],
    ),  # ties: first
    (
        CategoricalAccuracy,
        ([[0, 0, 1], [0, 1, 0]], [[0.1, 0.9, 0.8], [0.05, 0.95, 0.0]]),
        [0.7, 0.3],
        0.3,
        [0.3, 1.0],
    ),
]


@pytest.mark.parametrize("cls, args, weight, result, variables", KERAS_CASES)
def test_tf_keras_values_when_one_replica_has_the_batch(group, cls, args, weight, result, variables):
    """Rank 0 feeds the batch, the other replicas empty ones: the result is tf's at any size."""
    with group.strategy.scope():
        metric = cls()

    def step():
        sparse_labels = cls is SparseCategoricalAccuracy  # int labels; everything else float32
        mine = [
            np.asarray(a) if sparse_labels and i == 0 else np.asarray(a, np.float32)
            for i, a in enumerate(args)
        ]
        w = None if weight is None else np.asarray(weight, dtype=np.float32)
        if group.rank > 0:
            if mine[0].ndim == 0:
                return
            mine, w = [a[:0] for a in mine], None if w is None else w[:0]
        metric.update_state(*mine, sample_weight=w)

    group.strategy.run(step)
    with group.strategy.scope():
        got, totals = metric.result(), [float(v.numpy()) for v in metric.variables]
    ok = np.isclose(got, result, rtol=1e-6) and np.allclose(totals, variables, rtol=1e-6)
    all_ranks_agree(group.comm, ok and got.dtype == np.float32, f"{got!r} {totals}")


def test_calling_updates_and_returns_the_replica_local_result_and_reset_starts_over(group):
    with group.strategy.scope():
        mean = Mean(name="test_loss")
    rank = group.rank

    # Replica r adds r + 1 once; inside run, result() is this replica's own mean.
    local = group.strategy.run(lambda: mean(np.array([rank + 1.0, rank + 1.0], np.float32)))
    with group.strategy.scope():
        everyone = float(mean.result())
        mean.reset_state()
        after_reset = float(mean.result())
    group.strategy.run(lambda: mean.update_state(np.float32(10.0)))
    with group.strategy.scope():
        fresh = float(mean.result())
    n = group.size
    ok = float(local) == rank + 1.0 and everyone == (n + 1) / 2 and after_reset == 0.0 and fresh == 10.0
    all_ranks_agree(group.comm, ok and mean.name == "test_loss", f"{local} {everyone} {after_reset} {fresh}")


def test_outside_any_strategy_a_metric_is_local():
    acc = SparseCategoricalAccuracy()
    assert not isinstance(acc.variables[0], mpistrat.SyncOnReadVariable)
    assert float(
        acc(np.array([1, 0, 2]), np.array([[0, 1, 0], [1, 0, 0], [1, 0, 0]], np.float32))
    ) == np.float32(2 / 3)


def test_distributed_variables_are_sync_on_read_sums(group):
    with group.strategy.scope():
        metric = Mean()
    ok = all(
        isinstance(v, mpistrat.SyncOnReadVariable)
        and v.aggregation is mpistrat.VariableAggregation.SUM
        and not v.trainable
        and v.dtype == np.float32
        for v in metric.variables
    )
    assert ok and [v.name for v in metric.variables] == ["mean/total", "mean/count"]


def test_updating_in_cross_replica_context_is_an_error_on_every_rank(group):
    with group.strategy.scope():
        metric = Accuracy()
        raises_on_every_rank(
            group.comm, ContextError, lambda: metric.update_state([1.0], [1.0]), "inside strategy.run"
        )


@pytest.mark.parametrize(
    "cls, args, kwargs, message",
    [
        (Accuracy, ([1, 2, 3], [1.0, 2.0]), {}, "y_true must have y_pred's shape (2,); got shape (3,)"),
        (SparseCategoricalAccuracy, ([1, 2], np.ones((3, 4))), {}, "shape (3,); got shape (2,)"),
        (CategoricalAccuracy, (np.eye(3), np.ones((3, 4))), {}, "y_pred's shape (3, 4); got shape (3, 3)"),
        (Mean, ([1.0, 2.0],), {"sample_weight": [1.0, 2.0, 3.0]}, "does not broadcast"),
    ],
)
def test_bad_shapes_name_expected_and_got(cls, args, kwargs, message):
    with pytest.raises(InvalidArgumentError) as info:
        cls().update_state(*(np.asarray(a) for a in args), **kwargs)
    assert message in str(info.value)


def test_integer_dtype_is_refused():
    with pytest.raises(InvalidArgumentError, match="float dtype; got int32"):
        Mean(dtype=np.int32)
