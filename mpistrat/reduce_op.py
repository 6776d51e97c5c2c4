"""ReduceOp: how values from replicas are combined."""

from __future__ import annotations

import enum

from mpistrat.errors import enum_member

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
        return enum_member(cls, op, "reduce_op", "a ReduceOp or one of 'SUM', 'MEAN' (any case)")
