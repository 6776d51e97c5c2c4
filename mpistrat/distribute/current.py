"""The public ``get_strategy``, ``get_replica_context`` and ``get_cross_replica_context``:
:mod:`mpistrat.context`'s own functions, typed with the strategy's classes.

The context stack sits below the strategies, so it types what it holds by protocols
(:mod:`mpistrat.replicas`); what it holds are the :class:`Strategy` and :class:`ReplicaContext`
objects of this folder. These names are the same functions, so a call costs nothing more.

>>> from mpistrat import context
>>> get_strategy is context.get_strategy
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from mpistrat import context
from mpistrat.distribute.replica_context import ReplicaContext
from mpistrat.distribute.strategy_base import Strategy

__all__ = ["get_cross_replica_context", "get_replica_context", "get_strategy"]

get_strategy = cast("Callable[[], Strategy]", context.get_strategy)
get_replica_context = cast("Callable[[], ReplicaContext | None]", context.get_replica_context)
get_cross_replica_context = cast("Callable[[], Strategy | None]", context.get_cross_replica_context)
