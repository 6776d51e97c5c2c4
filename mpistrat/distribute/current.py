"""The public ``get_strategy``, ``get_replica_context`` and ``get_cross_replica_context``:
:mod:`mpistrat.context`'s, typed with the strategy's own classes.

The context stack sits below the strategies, so it types what it holds by protocols
(:mod:`mpistrat.replicas`); what it holds are the :class:`Strategy` and :class:`ReplicaContext`
objects of this folder, as a program's type checker should see them.

>>> from mpistrat import context
>>> get_strategy() is context.get_strategy()
True
"""

from __future__ import annotations

from typing import cast

from mpistrat import context
from mpistrat.distribute.replica_context import ReplicaContext
from mpistrat.distribute.strategy_base import Strategy

__all__ = ["get_cross_replica_context", "get_replica_context", "get_strategy"]


def get_strategy() -> Strategy:
    """The current strategy: the one in scope, else the default single-replica strategy."""
    return cast(Strategy, context.get_strategy())


def get_replica_context() -> ReplicaContext | None:
    """The current ``ReplicaContext``; None in a cross-replica context.

    Outside any scope this is the default strategy's replica context.
    """
    return cast("ReplicaContext | None", context.get_replica_context())


def get_cross_replica_context() -> Strategy | None:
    """The current strategy in a cross-replica context, else None."""
    return cast("Strategy | None", context.get_cross_replica_context())
