"""The default strategy: one replica, in effect outside any scope, as tf's ``_DefaultDistributionStrategy``.

Its extended, :class:`DefaultExtended`, overrides what differs from a strategy over ranks: its
communicator is ``COMM_SELF`` (not its own, never freed), its one replica holds every replica's value
(reductions are array arithmetic in every context), its variables are plain ones (``update`` writes
them as they are), and a merge_fn runs where it is called. Importing this module registers it as
what :func:`mpistrat.get_strategy` returns outside any scope.

>>> import mpistrat
>>> strategy = default_strategy()
>>> mpistrat.get_strategy() is strategy, float(strategy.extended.reduce_to("sum", 2.0, "/cpu:0"))
(True, 2.0)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from mpistrat.comm import devices
from mpistrat.distribute.extended import StrategyExtended
from mpistrat.distribute.reductions import LocalReducer, SpmdReducer
from mpistrat.distribute.replica_context import ReplicaContext
from mpistrat.distribute.strategy_base import Strategy
from mpistrat.errors import ContextError
from mpistrat.interface import modes
from mpistrat.options import CommunicationOptions

__all__ = ["DefaultExtended", "default_strategy"]


class _DefaultStrategy(Strategy):
    """The single-replica strategy in effect outside any scope."""

    def __init__(self) -> None:
        super().__init__(DefaultExtended(self))

    def _require_own(self, method: str) -> None:
        """Nothing to refuse: the default strategy's methods work in any scope, as tf's."""

    def _enter_scope(self, mode: modes.Mode) -> contextlib.AbstractContextManager[Any]:
        if mode.kind is modes.DEFAULT:  # as tf: it keeps its default replica context
            return modes.default_scope()
        return super()._enter_scope(mode)

    def _run_in_merge_fn(
        self, mode: modes.Mode, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """In its own merge_fn the one replica runs as ``run`` runs it anywhere else."""
        if mode.strategy is not self:
            raise ContextError(  # a RuntimeError, as tf's
                "Mixing different tf.distribute.Strategy objects: a scope of another strategy is already "
                "active"
            )
        self._extended.collectives  # noqa: B018 (raises if finalized)
        args = self._unwrap(args, 0) if args else ()
        kwargs = self._unwrap(kwargs, 0) if kwargs else {}
        with ReplicaContext(self, 0):
            return fn(*args, **kwargs)


class DefaultExtended(StrategyExtended):
    """The default strategy's :class:`StrategyExtended`: one replica, plain variables, nothing sent."""

    def __init__(self, container_strategy: Strategy):
        self._setup(container_strategy, MPI.COMM_SELF, CommunicationOptions(), "root", "the default strategy")
        self.placement = devices.cpu_placement()
        self._local = LocalReducer(1, self._options, _as_is)  # reduce_to and the like: nothing to send
        self._spmd = SpmdReducer(self)  # Strategy.reduce and gather outside a merge_fn, over COMM_SELF
        self._scope_owner = None  # variables created outside any scope belong to no strategy

    def _reductions(self, method: str) -> LocalReducer:
        self._require_cross_replica(method)
        return self._local

    def _enter(self, mode: modes.Mode) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Run ``fn(var, *args, **kwargs)``: the default strategy's variables are plain ones."""
        from mpistrat.distribute import updates  # a job that updates no variable never loads it

        self._require_cross_replica("update")
        (a, kw), _ = updates.select_replica((tuple(args), dict(kwargs or {})), 0, 1, "update")
        result = fn(var, *a, **kw)
        return result if group else updates.ungroup(result)

    def colocate_vars_with(self, colocate_with_variable: Any) -> contextlib.AbstractContextManager[None]:
        """Variables created inside record ``colocate_with_variable`` (any variable: no scope to check)."""
        return modes.colocation(self._container_strategy, colocate_with_variable)

    def call_merge_fn(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Call ``merge_fn`` here, in the merge context: the one replica holds every replica's values."""
        strategy = self._container_strategy
        with modes.push(modes.Mode(strategy, None, modes.MERGE)):
            return merge_fn(strategy, *args, **kwargs)


def _as_is(value: Any) -> Any:
    """A reduced value as the one replica holds it (no ``Mirrored`` around it)."""
    return value


@functools.lru_cache(maxsize=1)
def default_strategy() -> Strategy:
    """The default single-replica strategy (what ``get_strategy()`` returns outside a scope)."""
    return _DefaultStrategy()


modes.set_default_strategy(default_strategy)
