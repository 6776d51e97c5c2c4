"""ReduceOp: how values from replicas are combined."""

from __future__ import annotations

import enum

from mpistrat.errors import InvalidArgumentError

__all__ = ["ReduceOp"]


class ReduceOp(enum.Enum):
    """Reduction across replicas, as ``tf.distribute.ReduceOp``.

    >>> ReduceOp.from_any("mean")
    <ReduceOp.MEAN: 'MEAN'>
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_any(cls, op: ReduceOp | str) -> ReduceOp:
        """Accept a ``ReduceOp`` or its name in any case."""
        if isinstance(op, cls):
            return op
        if isinstance(op, str) and op.upper() in cls.__members__:
            return cls[op.upper()]
        raise InvalidArgumentError(
            f"reduce_op must be a ReduceOp or one of 'SUM', 'MEAN' (any case); got {op!r}"
        )
