"""ReduceOp: how values from replicas are combined."""

from __future__ import annotations

import enum

from mpistrat.errors import InvalidArgumentError, enum_member

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
        try:
            return enum_member(cls, op, "reduce_op", "a ReduceOp or one of 'SUM', 'MEAN' (any case)")
        except InvalidArgumentError as exc:  # with tf's words first, which ported code may match
            raise InvalidArgumentError(f"{op!r} is not a valid ReduceOp: {exc}") from None
