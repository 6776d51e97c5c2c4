"""The public ``get_strategy``, ``get_replica_context`` and ``get_cross_replica_context``:
:mod:`mpistrat.interface.modes`'s, typed with the strategy's own classes.

The mode stack sits below the strategies, so it types what it holds by protocols
(:mod:`mpistrat.interface.protocols`); what it holds are the :class:`Strategy` and :class:`ReplicaContext`
objects of this folder, as a program's type checker should see them.

>>> from mpistrat.interface import modes
>>> get_strategy() is modes.get_strategy()
True
"""

from __future__ import annotations

from typing import cast

from mpistrat.distribute.replica_context import ReplicaContext
from mpistrat.distribute.strategy_base import Strategy
from mpistrat.interface import modes

__all__ = ["get_cross_replica_context", "get_replica_context", "get_strategy"]


def get_strategy() -> Strategy:
    """The current strategy: the one in scope, else the default single-replica strategy."""
    return cast(Strategy, modes.get_strategy())


def get_replica_context() -> ReplicaContext | None:
    """The current ``ReplicaContext``; None in a cross-replica context.

    Outside any scope this is the default strategy's replica context.
    """
    return cast("ReplicaContext | None", modes.get_replica_context())


def get_cross_replica_context() -> Strategy | None:
    """The current strategy in a cross-replica context, else None."""
    return cast("Strategy | None", modes.get_cross_replica_context())
