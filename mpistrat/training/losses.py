"""Loss scaling for data parallelism, as ``tf.nn.compute_average_loss`` and ``scale_regularization_loss``.

Each replica sums its own per-example losses and divides by the number of
examples in the *global* batch, so summing the replicas' results (which is what
all-reducing gradients does) gives the mean over every example of the step, even
when some replicas have short or empty batches.

>>> import numpy as np
>>> float(compute_average_loss(np.array([1.0, 2.0, 3.0]), global_batch_size=6))
1.0
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpistrat.comm.packing import array_module
from mpistrat.errors import ContextError, InvalidArgumentError
from mpistrat.interface import modes
from mpistrat.reduce_op import ReduceOp

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def _require_replica_context(function: str) -> modes.Mode:
    """The current mode, unless it is a strategy's cross-replica context (tf raises RuntimeError there)."""
    mode = modes.current_mode()
    if mode.kind is not modes.DEFAULT and mode.replica_context is None:
        raise ContextError(
            f"You are calling `{function}` in cross replica context (strategy.scope() or a merge_fn), while "
            "it was expected to be called in replica context (inside strategy.run)"
        )
    return mode


def _global_count(local: int) -> int:
    """The number of examples of this step over every replica (a collective)."""
    mode = _require_replica_context("compute_average_loss")
    if mode.kind is modes.MERGE:
        raise ContextError(
            "compute_average_loss: without global_batch_size it counts the examples of every replica, "
            "which cannot be done inside merge_fn (rank 0 alone); pass global_batch_size"
        )
    collectives = mode.strategy.extended.collectives
    return int(collectives.all_reduce(ReduceOp.SUM, np.int64(local), kind="compute_average_loss"))


def compute_average_loss(
    per_example_loss: Any, sample_weight: Any = None, global_batch_size: int | None = None
) -> Any:
    """``sum(per_example_loss * sample_weight) / global_batch_size`` for this replica.

    >>> import numpy as np
    >>> float(compute_average_loss(np.array([2.0, 4.0]), sample_weight=np.array([1.0, 0.5])))
    2.0

    Args:
        per_example_loss: this replica's losses, leading dimension the batch
            (an empty batch is fine and contributes 0).
        sample_weight: optional weights broadcast against ``per_example_loss``.
        global_batch_size: the number of examples in this step over all replicas.
            When None, it is counted: an all-reduce over the current strategy's
            replicas (so every replica must call this at the same step, in replica
            context). tf instead takes ``local batch size * num_replicas_in_sync``,
            which is the same on even batches and wrong on uneven ones.

    Returns:
        A 0-d array of the loss's float dtype (float64 for integer losses); 0 when
        the global batch is empty.
    """
    xp = array_module(per_example_loss)
    loss = xp.asarray(per_example_loss)
    if loss.ndim == 0:
        raise InvalidArgumentError(
            "compute_average_loss: per_example_loss must have a leading batch dimension (rank >= 1); "
            f"got a scalar {per_example_loss!r}. Pass the per-example losses, not their mean"
        )
    if loss.dtype.kind not in "fc":
        loss = loss.astype(np.float64)
    if sample_weight is not None:
        loss = loss * xp.asarray(sample_weight, dtype=loss.dtype)
    if global_batch_size is None:
        global_batch_size = _global_count(int(loss.shape[0]))
    elif (
        isinstance(global_batch_size, bool)
        or not isinstance(global_batch_size, (int, np.integer))
        or global_batch_size < 0
    ):
        raise InvalidArgumentError(
            f"compute_average_loss: global_batch_size must be an int >= 0 or None; got {global_batch_size!r}"
        )
    total = loss.sum()
    if global_batch_size == 0:
        return xp.zeros((), dtype=loss.dtype)
    return total / xp.asarray(global_batch_size, dtype=loss.dtype)


def scale_regularization_loss(regularization_loss: Any) -> Any:
    """``sum(regularization_loss) / num_replicas_in_sync``, as ``tf.nn.scale_regularization_loss``.

    Summing the replicas' results, as all-reducing gradients does, then counts the
    regularization once. Called in replica context (or outside any strategy).

    >>> import numpy as np
    >>> float(scale_regularization_loss(np.array([1.0, 5.0])))
    6.0

    Args:
        regularization_loss: an array or number, or a list of them (all are summed).

    Returns:
        A 0-d array of the loss's float dtype (float64 for integers and Python numbers).
    """
    mode = _require_replica_context("scale_regularization_loss")
    parts = regularization_loss if isinstance(regularization_loss, (list, tuple)) else [regularization_loss]
    if not parts:
        raise InvalidArgumentError("scale_regularization_loss: got an empty list of losses")
    xp = array_module(parts[0])
    total = xp.asarray(parts[0]).sum()
    for part in parts[1:]:
        total = total + xp.asarray(part).sum()
    total = xp.asarray(total)
    if total.dtype.kind not in "fc":
        total = total.astype(np.float64)
    return total / xp.asarray(mode.strategy.num_replicas_in_sync, dtype=total.dtype)
