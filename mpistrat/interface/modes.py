"""Which strategy and which context (replica or cross-replica) this thread is in.

A thread-local stack of modes. Outside any scope the mode is the *default* one:
the default single-replica strategy, in its default replica context.

>>> in_cross_replica_context(), has_strategy()
(False, False)
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
from collections.abc import Callable, Iterator
from typing import Any

from mpistrat.errors import ContextError
from mpistrat.interface.protocols import ReplicaContextProtocol, StrategyProtocol

__all__ = [
    "ModeKind",
    "Mode",
    "experimental_set_strategy",
    "get_strategy",
    "has_strategy",
    "get_replica_context",
    "get_cross_replica_context",
    "in_cross_replica_context",
]

CROSS_REPLICA_HINT = "use get_replica_context().merge_call()"


class ModeKind(enum.Enum):
    """Which context a :class:`Mode` is.

    ``DEFAULT``: no scope. ``CROSS_REPLICA``: SPMD, inside ``scope()`` (or a merge_fn run on every
    rank): every rank executes. ``REPLICA``: inside ``run``. ``MERGE``: inside a root-mode ``merge_fn``:
    rank 0 alone, holding every replica's values (or the default strategy's merge_fn).
    """

    DEFAULT = "default"
    CROSS_REPLICA = "cross_replica"
    REPLICA = "replica"
    MERGE = "merge"


# The members as module names, for ``mode.kind is modes.MERGE``: on Python 3.11 an Enum's class
# attribute costs a lookup through its metaclass (~80 ns), on paths that run at every step.
DEFAULT = ModeKind.DEFAULT
CROSS_REPLICA = ModeKind.CROSS_REPLICA
REPLICA = ModeKind.REPLICA
MERGE = ModeKind.MERGE


@dataclasses.dataclass(frozen=True)
class Mode:
    """One entry of the stack: a strategy, its replica context (None in cross-replica context), a kind.

    A ``MERGE`` mode with a ``replica_context`` is ``strategy.run`` called inside such a merge_fn:
    one replica at a time on rank 0 alone, where nothing may communicate.
    """

    strategy: StrategyProtocol
    replica_context: ReplicaContextProtocol | None
    kind: ModeKind
    # A scope entered inside the default strategy's explicit scope(): as in tf, creating a
    # variable there mixes two strategies and is refused.
    inside_default: bool = False


_local = threading.local()


def _stack() -> list[Mode]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current_mode() -> Mode:
    stack = _stack()
    if stack:
        return stack[-1]
    global _default_mode
    strategy = _default_strategy()
    mode = _default_mode
    if mode is None or mode.strategy is not strategy:  # Modes are frozen: one per default strategy
        mode = _default_mode = Mode(strategy, strategy.extended.default_replica_context, DEFAULT)
    return mode


_default_mode: Mode | None = None


def default_strategy() -> StrategyProtocol:
    """The strategy in effect outside any scope (single replica)."""
    return _default_strategy()


def set_default_strategy(factory: Callable[[], StrategyProtocol]) -> None:
    """Register what ``get_strategy()`` returns outside any scope (``distribute/default.py`` does,
    on import)."""
    global _default_strategy
    _default_strategy = factory


def _no_default_strategy() -> StrategyProtocol:
    raise ContextError("no default strategy: import mpistrat (not mpistrat.interface.modes alone)")


_default_strategy: Callable[[], StrategyProtocol] = _no_default_strategy


def in_default_scope() -> bool:
    """Whether the default strategy's ``scope()`` is entered on this thread (it pushes no mode)."""
    return getattr(_local, "default_scopes", 0) > 0


@contextlib.contextmanager
def default_scope() -> Iterator[None]:
    """Mark the default strategy's ``scope()`` as entered inside the block."""
    _local.default_scopes = getattr(_local, "default_scopes", 0) + 1
    try:
        yield
    finally:
        _local.default_scopes -= 1


def push(mode: Mode) -> _Pushed:
    """``with push(mode):`` makes ``mode`` current inside the block."""
    return _Pushed(mode)


class _Pushed:
    """A ``push`` block (a class, not a generator: ``strategy.run`` enters one at every step)."""

    __slots__ = ("mode",)

    def __init__(self, mode: Mode):
        self.mode = mode

    def __enter__(self) -> Mode:
        _stack().append(self.mode)
        return self.mode

    def __exit__(self, *exc_info: Any) -> None:
        _stack().pop()


@contextlib.contextmanager
def colocation(strategy: StrategyProtocol, target: Any) -> Iterator[None]:
    """A ``colocate_vars_with`` block of ``strategy``: variables created in it are placed with ``target``."""
    stack = getattr(_local, "colocation", None)
    if stack is None:
        stack = _local.colocation = []
    stack.append((strategy, target))
    try:
        yield
    finally:
        stack.pop()


def current_colocation() -> tuple[StrategyProtocol, Any] | None:
    """The innermost ``colocate_vars_with`` block of this thread: ``(strategy, target)``, or None."""
    stack = getattr(_local, "colocation", None)
    return stack[-1] if stack else None


def get_strategy() -> StrategyProtocol:
    """The current strategy: the one in scope, else the default single-replica strategy."""
    return current_mode().strategy


def has_strategy() -> bool:
    """True inside a non-default strategy's ``scope()`` or ``run`` (not in the default strategy's
    ``merge_fn``), or after :func:`experimental_set_strategy`."""
    return current_mode().strategy is not _default_strategy()


def experimental_set_strategy(strategy: StrategyProtocol | None) -> None:
    """Make ``strategy`` current for this thread until it is set again, as if its ``scope()`` were entered.

    ``None`` goes back to the default strategy. Not inside a strategy's scope (a
    ``ContextError``, a ``RuntimeError`` as tf's).

    >>> import mpistrat
    >>> strategy = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
    >>> experimental_set_strategy(strategy)
    >>> get_strategy() is strategy, in_cross_replica_context()
    (True, True)
    >>> experimental_set_strategy(None)
    >>> has_strategy()
    False
    """
    stack = _stack()
    current = getattr(_local, "set_strategy", None)
    if stack and not (current is not None and len(stack) == 1 and stack[0] is current):
        raise ContextError(
            "experimental_set_strategy: Must not be called inside a `tf.distribute.Strategy` scope. Leave "
            "the strategy's scope() first"
        )
    stack.clear()
    _local.set_strategy = None
    if strategy is not None and strategy is not _default_strategy():
        strategy.extended.collectives  # noqa: B018 (raises if finalized)
        mode = Mode(strategy, None, CROSS_REPLICA)
        stack.append(mode)
        _local.set_strategy = mode


def get_replica_context() -> ReplicaContextProtocol | None:
    """The current ``ReplicaContext``; None in a cross-replica context.

    Outside any scope this is the default strategy's replica context.
    """
    return current_mode().replica_context


def get_cross_replica_context() -> StrategyProtocol | None:
    """The current strategy in a cross-replica context, else None."""
    mode = current_mode()
    return mode.strategy if mode.replica_context is None else None


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` (but not in ``run``) or inside a ``merge_fn``."""
    return current_mode().replica_context is None


def require_cross_replica(method: str) -> Mode:
    """The current mode, if it is cross-replica (or the default context); else raise."""
    mode = current_mode()
    if mode.replica_context is not None and mode.kind is not DEFAULT:
        raise ContextError(f"{method}: Method requires being in cross-replica context, {CROSS_REPLICA_HINT}")
    return mode


def require_replica(method: str) -> Mode:
    """The current mode, if it is a replica context that may communicate; else raise.

    Not ``strategy.run`` inside a root-mode merge_fn: it runs every replica in turn on rank 0 alone.
    """
    mode = current_mode()
    if mode.replica_context is None:
        raise ContextError(
            f"{method}: Method requires being in replica context; "
            "call it inside strategy.run(fn), not in cross-replica context"
        )
    if mode.kind is MERGE:
        raise ContextError(
            f"{method}: this is strategy.run inside a merge_fn, which runs every replica "
            "in turn on rank 0 alone, so it cannot communicate; use "
            "MPIStrategy(merge_call='every_rank'), or call strategy.run outside merge_fn"
        )
    return mode
