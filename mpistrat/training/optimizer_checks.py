"""The checks an optimizer makes of its variables and of where it is called.

>>> import mpistrat, numpy as np
>>> not_floating("SGD", [mpistrat.Variable(np.arange(2))]) is not None
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpistrat import context
from mpistrat.errors import ContextError, InvalidArgumentError

if TYPE_CHECKING:
    from mpistrat.training.variables import Variable

__all__ = ["SAME_BUILD", "not_floating", "own_replica_strategy"]


def own_replica_strategy(name: str, strategy: Any, variables: list[Variable]) -> Any:
    """The step runs in the replica context of its variables' strategy (else it would reduce over
    another communicator, or not at all), and not in ``strategy.run`` inside a merge_fn.

    Returns that strategy; None for the default strategy's plain variables (nothing to send).
    """
    mode = context.require_replica("ReplicaContext.apply_gradients")
    mine = strategy or context.default_strategy()
    if mode.strategy is not mine and strategy is None:
        # Plain variables hold one unsynchronized copy per rank: no step of a strategy may write them.
        names = ", ".join(repr(v.name) for v in variables[:3]) + (", ..." if len(variables) > 3 else "")
        raise InvalidArgumentError(
            f"{name}.apply_gradients: the variables ({names}) and the optimizer were created "
            f"outside any strategy's scope, but this is the replica context of {mode.strategy}; "
            "create the variables and the optimizer inside `with strategy.scope():`"
        )
    if mode.strategy is not mine:
        raise ContextError(
            f"{name}.apply_gradients: its variables belong to {mine}, but this is the replica "
            f"context of {mode.strategy}; call it inside that strategy's run: "
            "`strategy.run(lambda: opt.apply_gradients(...))`"
        )
    return strategy


def not_floating(name: str, variables: list[Variable]) -> InvalidArgumentError | None:
    """The error for variables an optimizer cannot update (integer, bool: ``w -= lr * g``), if any."""
    bad = [f"{v.name!r} ({v.dtype})" for v in variables if v.dtype.kind not in "fc"]
    if not bad:
        return None
    return InvalidArgumentError(
        f"{name}: cannot update variables of a non-floating dtype: {', '.join(bad)}; make them float, "
        "or leave them out of apply_gradients (trainable=False)"
    )


SAME_BUILD = (
    "Every rank must build the optimizer with the same shard_state and for the same variables: "
    "create the optimizer the same way on every rank and pass every rank the same variables."
)
