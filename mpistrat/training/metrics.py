"""Streaming metrics on sync-on-read variables, as ``tf.keras.metrics`` under a strategy.

A metric keeps running totals in float32 variables created with
``synchronization=ON_READ, aggregation=SUM``: inside ``strategy.run`` each replica adds its
own examples to its own copy (no communication), and ``result()`` in cross-replica context
sums the copies over every rank, so it is the metric of all the examples every replica
saw. Create a metric in ``strategy.scope()``, update it in replica context, read and
reset it in cross-replica context (on every rank: reading is a collective). Outside any
strategy it is an ordinary single-process metric.

The update rules are Keras 3's (``tf.keras`` in TensorFlow 2.16 and later): values of
rank above 1 are first averaged (``Mean``) or summed (``Sum``) to one value per example,
and ``result()`` is ``total / count``, or 0 before any example.

>>> import numpy as np
>>> m = Mean()
>>> m.update_state(np.array([1.0, 2.0, 3.0]), sample_weight=np.array([1.0, 0.0, 2.0]))
>>> round(float(m.result()), 4)  # (1 + 0 + 6) / (1 + 0 + 2)
2.3333
>>> acc = SparseCategoricalAccuracy()
>>> float(acc(np.array([2, 1]), np.array([[0.1, 0.6, 0.3], [0.05, 0.95, 0.0]])))
0.5
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpistrat.comm import packing
from mpistrat.errors import ContextError, InvalidArgumentError
from mpistrat.interface import modes
from mpistrat.training.distributed_variables import DistributedVariable
from mpistrat.training.variables import Variable

__all__ = ["Metric", "Mean", "Sum", "Accuracy", "SparseCategoricalAccuracy", "CategoricalAccuracy"]


class Metric:
    """Base class: named float variables, ``reset_state``, and calling as update-then-result.

    Subclasses create their variables with :meth:`add_variable` and implement
    ``update_state`` and ``result``.
    """

    def __init__(self, name: str, dtype: Any = None):
        self._name = str(name)
        self._dtype = np.dtype(np.float32 if dtype is None else dtype)
        if self._dtype.kind != "f":
            raise InvalidArgumentError(
                f"{type(self).__name__}: dtype must be a float dtype; got {self._dtype}"
            )
        self._variables: list[Variable] = []

    name = property(lambda self: self._name, doc="The metric's name.")
    dtype = property(lambda self: self._dtype, doc="The dtype of its variables and result (float32).")

    @property
    def variables(self) -> list[Variable]:
        """Its variables (e.g. to track them in a ``Checkpoint``)."""
        return list(self._variables)

    def add_variable(self, name: str) -> Variable:
        """A zero scalar of the metric's dtype, sync-on-read with SUM aggregation in a strategy."""
        var = Variable(
            np.zeros((), self._dtype),
            name=f"{self._name}/{name}",
            trainable=False,
            synchronization="ON_READ",
            aggregation="SUM",
        )
        self._variables.append(var)
        return var

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def result(self) -> Any:
        raise NotImplementedError

    def reset_state(self) -> None:
        """Set every variable to 0 (in cross-replica context, on every rank)."""
        for var in self._variables:
            var.assign(np.zeros((), self._dtype))

    reset_states = reset_state  # tf.keras 2's name, which tf.distribute's tutorials call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``update_state(*args, **kwargs)``, then ``result()``."""
        self.update_state(*args, **kwargs)
        return self.result()

    def _check_replica_context(self) -> None:
        """Updates of distributed copies happen inside ``strategy.run``, where each replica owns its copy."""
        if (
            self._variables
            and isinstance(self._variables[0], DistributedVariable)
            and modes.current_mode().kind is not modes.REPLICA
        ):
            raise ContextError(
                f"{type(self).__name__} {self._name!r}.update_state: a metric created in a strategy's "
                "scope is updated in replica context; call update_state inside strategy.run (each replica "
                "adds its own examples), and read result() outside it"
            )

    def __repr__(self) -> str:
        return f"<mpistrat.metrics.{type(self).__name__} name={self._name!r}>"


class Sum(Metric):
    """The (weighted) sum of the values, as ``tf.keras.metrics.Sum``.

    >>> s = Sum()
    >>> s.update_state(np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), sample_weight=np.array([1.0, 0.5]))
    >>> float(s.result())  # 6 * 1 + 15 * 0.5
    13.5
    """

    def __init__(self, name: str = "sum", dtype: Any = None):
        super().__init__(name, dtype)
        self.total = self.add_variable("total")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Add ``sum(values * sample_weight)`` (weights broadcast against ``values``)."""
        self._check_replica_context()
        values, _ = _samplewise(values, sample_weight, "sum", self._dtype, self._name)
        self.total.assign_add(values.sum())

    def result(self) -> Any:
        """The sum: over every replica's updates in cross-replica context."""
        total = self.total.value()
        return packing.array_module(total).array(total, dtype=self._dtype, copy=True)


class Mean(Metric):
    """The (weighted) mean of the values, as ``tf.keras.metrics.Mean``: ``total / count``.

    >>> m = Mean(name="test_loss")
    >>> m.update_state(np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))  # per example: 2 and 5
    >>> float(m.result()), float(m.count.numpy())
    (3.5, 2.0)
    """

    def __init__(self, name: str = "mean", dtype: Any = None):
        super().__init__(name, dtype)
        self.total = self.add_variable("total")
        self.count = self.add_variable("count")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Add ``sum(values * sample_weight)`` to the total and ``sum(sample_weight)`` (or the
        number of examples) to the count."""
        self._check_replica_context()
        values, weight = _samplewise(values, sample_weight, "mean", self._dtype, self._name)
        self.total.assign_add(values.sum())
        if weight is not None:
            self.count.assign_add(weight.sum())
        else:
            self.count.assign_add(values.shape[0] if values.ndim else 1)

    def result(self) -> Any:
        """``total / count`` (0 while the count is 0): over every replica in cross-replica context."""
        total, count = self.total.value(), self.count.value()
        xp = packing.array_module(total)
        if not count:
            return xp.zeros((), self._dtype)
        return xp.asarray(total / count, dtype=self._dtype)


class _MeanOf(Mean):
    """The mean of ``fn(y_true, y_pred)`` over the examples (Keras's ``MeanMetricWrapper``)."""

    _fn: Callable[[Any, Any, str], Any]

    # Keras's signature: its MeanMetricWrapper subclasses Mean and takes (y_true, y_pred) too.
    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        """Add this batch: ``y_true`` the labels, ``y_pred`` the predictions, one row per example."""
        self._check_replica_context()
        xp = packing.array_module(y_pred)
        matches = type(self)._fn(
            xp.asarray(y_true), xp.asarray(y_pred), f"{type(self).__name__} {self._name!r}"
        )
        super().update_state(matches.astype(self._dtype), sample_weight)


class Accuracy(_MeanOf):
    """How often ``y_pred`` equals ``y_true``, as ``tf.keras.metrics.Accuracy``.

    >>> a = Accuracy()
    >>> float(a(np.array([1, 2, 3, 4]), np.array([0.0, 2.0, 3.0, 4.0])))
    0.75
    """

    def __init__(self, name: str = "accuracy", dtype: Any = None):
        super().__init__(name, dtype)

    @staticmethod
    def _fn(y_true: Any, y_pred: Any, who: str) -> Any:
        y_true, y_pred = _same_rank(y_true.astype(y_pred.dtype), y_pred)
        _check_shape(who, "y_true", y_true.shape, y_pred.shape, "y_pred's")
        return y_true == y_pred


class SparseCategoricalAccuracy(_MeanOf):
    """How often ``argmax(y_pred, axis=-1)`` equals the integer label ``y_true``, as
    ``tf.keras.metrics.SparseCategoricalAccuracy``. Labels of shape ``(N,)`` or ``(N, 1)``.

    >>> a = SparseCategoricalAccuracy()
    >>> a.update_state(np.array([2, 1]), np.array([[0.1, 0.6, 0.3], [0.05, 0.95, 0.0]]),
    ...                sample_weight=np.array([0.7, 0.3]))
    >>> round(float(a.result()), 6)
    0.3
    """

    def __init__(self, name: str = "sparse_categorical_accuracy", dtype: Any = None):
        super().__init__(name, dtype)

    @staticmethod
    def _fn(y_true: Any, y_pred: Any, who: str) -> Any:
        if y_pred.ndim < 1 or y_pred.shape[-1] < 1:
            raise InvalidArgumentError(
                f"{who}: y_pred must hold one score per class along its last axis; got shape {y_pred.shape}"
            )
        if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
            y_true = y_true[..., 0]
        _check_shape(who, "y_true", y_true.shape, y_pred.shape[:-1], "y_pred's without its class axis")
        return y_true == y_pred.argmax(axis=-1).astype(y_true.dtype)


class CategoricalAccuracy(_MeanOf):
    """How often ``argmax(y_pred)`` equals ``argmax(y_true)`` (one-hot labels), as
    ``tf.keras.metrics.CategoricalAccuracy``.

    >>> a = CategoricalAccuracy()
    >>> float(a(np.array([[0, 0, 1], [0, 1, 0]]), np.array([[0.1, 0.9, 0.8], [0.05, 0.95, 0.0]])))
    0.5
    """

    def __init__(self, name: str = "categorical_accuracy", dtype: Any = None):
        super().__init__(name, dtype)

    @staticmethod
    def _fn(y_true: Any, y_pred: Any, who: str) -> Any:
        _check_shape(who, "y_true", y_true.shape, y_pred.shape, "y_pred's")
        if y_pred.ndim < 1 or y_pred.shape[-1] < 1:
            raise InvalidArgumentError(
                f"{who}: expected one score per class along the last axis; got {y_pred.shape}"
            )
        return y_true.argmax(axis=-1) == y_pred.argmax(axis=-1)


def _check_shape(who: str, what: str, got: tuple[int, ...], want: tuple[int, ...], whose: str) -> None:
    if tuple(got) != tuple(want):
        raise InvalidArgumentError(
            f"{who}.update_state: {what} must have {whose} shape {tuple(want)}; got shape {tuple(got)}"
        )


def _same_rank(x1: Any, x2: Any) -> tuple[Any, Any]:
    """Keras's ``squeeze_or_expand_to_same_rank``: ranks that differ by a trailing 1 are aligned."""
    xp = packing.array_module(x1)
    if x1.ndim == x2.ndim + 1 and x1.shape[-1] == 1:
        return (x1, xp.expand_dims(x2, -1)) if x2.ndim == 1 else (x1[..., 0], x2)
    if x2.ndim == x1.ndim + 1 and x2.shape[-1] == 1:
        return (xp.expand_dims(x1, -1), x2) if x1.ndim == 1 else (x1, x2[..., 0])
    return x1, x2


def _samplewise(values: Any, sample_weight: Any, how: str, dtype: np.dtype, name: str) -> tuple[Any, Any]:
    """Keras's ``reduce_to_samplewise_values``: weighted values (and weights) reduced to one per example."""
    xp = packing.array_module(values)
    values = xp.asarray(values).astype(dtype, copy=False)
    reduce = getattr(xp, how)
    if sample_weight is not None:
        weight = xp.asarray(sample_weight).astype(dtype, copy=False)
        values, weight = _same_rank(values, weight)
        if values.ndim > weight.ndim:
            values = reduce(values, axis=tuple(range(weight.ndim, values.ndim)))
        try:
            weight = xp.broadcast_to(weight, values.shape)
        except ValueError:
            raise InvalidArgumentError(
                f"metric {name!r}.update_state: sample_weight of shape {tuple(weight.shape)} does not "
                f"broadcast to the values' shape {tuple(values.shape)}"
            ) from None
        values = values * weight
        if weight.ndim > 1:
            weight = reduce(weight, axis=tuple(range(1, weight.ndim)))
        sample_weight = weight
    if values.ndim > 1:
        values = reduce(values, axis=tuple(range(1, values.ndim)))
    return values, sample_weight
