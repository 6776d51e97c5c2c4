"""The current replica context, for tool code that runs only in replica context.

>>> import mpistrat
>>> replica_context() is mpistrat.get_replica_context()  # the default strategy's
True
"""

from __future__ import annotations

import mpistrat
from mpistrat.errors import ContextError

__all__ = ["replica_context"]


def replica_context() -> mpistrat.ReplicaContext:
    """``mpistrat.get_replica_context()``, raising where it is None (cross-replica context)."""
    ctx = mpistrat.get_replica_context()
    if ctx is None:
        raise ContextError("this benchmark step must run in replica context (strategy.run or no scope)")
    return ctx
