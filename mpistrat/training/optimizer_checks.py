"""The checks an optimizer makes of its variables and of where it is called.

>>> import mpistrat, numpy as np
>>> not_floating("SGD", [mpistrat.Variable(np.arange(2))]) is not None
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from mpistrat.collectives.fingerprint import checksum, code_of
from mpistrat.collectives.handshake import check_level
from mpistrat.errors import ContextError, InvalidArgumentError
from mpistrat.interface import modes

if TYPE_CHECKING:
    from mpistrat.interface.protocols import StrategyProtocol
    from mpistrat.options import CommunicationOptions
    from mpistrat.training.variables import Variable

__all__ = [
    "SAME_BUILD",
    "adopted_strategy",
    "compare_copies",
    "creation_scope",
    "not_floating",
    "own_replica_strategy",
]


def adopted_strategy(name: str, strategy: Any, unused: bool, var: Variable) -> Any:
    """The strategy of optimizer ``name`` once it updates ``var``: its variables' (an ``unused``
    optimizer takes the first one's); a variable of another strategy, or of none, is an error."""
    owner = var.distribute_strategy
    if strategy is None and unused:
        strategy = owner
    if owner is strategy:
        return strategy
    if owner is None:
        fix = "create it inside `with strategy.scope():`"
    elif strategy is None:
        fix = "create the optimizer, and its other variables, inside `with strategy.scope():`"
    else:
        fix = "use one optimizer per strategy"
    where = "was created outside any strategy's scope" if owner is None else f"belongs to {owner}"
    mine = "outside any scope" if strategy is None else f"in {strategy}"
    raise InvalidArgumentError(
        f"{name}: variable {var.name!r} {where}, but this optimizer updates variables {mine}; {fix}"
    )


@contextlib.contextmanager
def creation_scope(name: str, strategy: Any) -> Iterator[None]:
    """Enter ``strategy`` (the variables') from the default context to create an optimizer's
    variables; refuse inside merge_fn (rank 0 alone)."""
    mode = modes.current_mode()
    if mode.kind is modes.MERGE:
        raise ContextError(
            f"{name}: cannot create slot variables inside merge_fn (rank 0 alone); call "
            "optimizer.build(var_list) in strategy.scope() first"
        )
    if strategy is not None and mode.kind is modes.DEFAULT:
        with strategy.scope():
            yield
    else:
        yield


def own_replica_strategy(
    name: str, strategy: StrategyProtocol | None, variables: list[Variable]
) -> StrategyProtocol | None:
    """The step runs in the replica context of its variables' strategy (else it would reduce over
    another communicator, or not at all), and not in ``strategy.run`` inside a merge_fn.

    Returns that strategy; None for the default strategy's plain variables (nothing to send).
    """
    mode = modes.require_replica("ReplicaContext.apply_gradients")
    mine = strategy or modes.default_strategy()
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
    "Every rank must build the optimizer with the same shard_state and communication_options and for "
    "the same variables: "
    "create the optimizer the same way on every rank and pass every rank the same variables."
)


def compare_copies(
    collectives: Any,
    written: Iterable[tuple[Any, Any]],
    kind: str,
    options: CommunicationOptions | None = None,
) -> None:
    """Under ``MPISTRAT_CHECK=strict`` (or an optimizer's ``check="strict"``, ``options``): every
    variable a step wrote (``(name, this rank's array)`` pairs) holds the same bytes on every rank,
    else ``CollectiveMismatchError`` on every rank."""
    if collectives is None or check_level(collectives, options) < 2:
        return
    sums = [(repr(name), checksum(array)) for name, array in written]
    collectives.agree(
        f"{kind} (strict check)",
        fingerprint=code_of(*sums),
        describe=lambda: {
            "leaves": [(f"variable {name}", f"checksum {c:016x}", None) for name, c in sums],
            "advice": DIVERGED,
        },
        options=options,
    )


DIVERGED = (
    "The copies of a variable differ between ranks after the optimizer's step (MPISTRAT_CHECK=strict "
    "compares their checksums): the ranks applied different updates. Look for a variable written on one "
    "rank alone, or for non-deterministic arithmetic."
)
