"""ReplicaContext: the API available inside ``strategy.run(fn)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpistrat.errors import ContextError
from mpistrat.interface import modes
from mpistrat.options import CommunicationOptions
from mpistrat.reduce_op import ReduceOp

if TYPE_CHECKING:
    from mpistrat.distribute.strategy_base import Strategy

__all__ = ["ReplicaContext"]


class ReplicaContext:
    """One replica's view: this rank, its id, and collectives with the other replicas.

    >>> import mpistrat
    >>> ctx = mpistrat.get_replica_context()  # the default single-replica context
    >>> ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync
    (0, 1)
    >>> ctx.all_reduce("sum", {"a": 1.0})
    {'a': np.float64(1.0)}
    """

    # A replica that strategy.run inside a root-mode merge_fn runs in turn on rank 0: what its
    # merge_call waits in (see mpistrat.distribute.in_turn).
    _in_turn: Any = None

    def __init__(self, strategy: Strategy, replica_id_in_sync_group: int):
        self._strategy = strategy
        self._replica_id = int(replica_id_in_sync_group)
        self._modes: list[Any] = []

    def __enter__(self) -> ReplicaContext:
        push = modes.push(modes.Mode(self._strategy, self, modes.REPLICA))
        push.__enter__()
        self._modes.append(push)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._modes.pop().__exit__(*exc_info)

    @property
    def strategy(self) -> Strategy:
        """The strategy this replica belongs to."""
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id: the rank in the strategy's communicator."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas kept in sync: the communicator's size."""
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self) -> tuple[str, ...]:
        """The device this replica runs on, as a one-element tuple of strings."""
        return self._strategy.extended.worker_devices

    def all_reduce(
        self, reduce_op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None
    ) -> Any:
        """All-reduce a nest of arrays across replicas (every replica must call it).

        >>> import mpistrat
        >>> mpistrat.get_replica_context().all_reduce("mean", [1, 98])
        [np.float64(1.0), np.float64(98.0)]

        Args:
            reduce_op: ``ReduceOp.SUM``/``MEAN`` or ``"sum"``/``"mean"``.
            value: a nest of arrays and numbers, the same structure, dtypes and
                shapes on every replica.
            options: overrides the strategy's ``CommunicationOptions``.

        Returns:
            The reduced nest, same structure; MEAN divides truly (ints give floats).
        """
        self._require_current("all_reduce")
        return self._strategy.extended.collectives.all_reduce(reduce_op, value, options)

    def all_gather(self, value: Any, axis: int, options: CommunicationOptions | None = None) -> Any:
        """Concatenate every replica's arrays along ``axis``, in replica order.

        Shapes must agree in every dimension but ``axis``; sizes along ``axis`` may differ.

        >>> import mpistrat, numpy as np
        >>> mpistrat.get_replica_context().all_gather({"a": np.array([0])}, axis=0)
        {'a': array([0])}
        """
        self._require_current("all_gather")
        return self._strategy.extended.collectives.all_gather(value, axis, options)

    def merge_call(
        self, merge_fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Run ``merge_fn(strategy, *args, **kwargs)`` in cross-replica context.

        By default (``MPIStrategy(merge_call="root")``) every rank's ``args``/``kwargs``
        are gathered to rank 0, where array and differing leaves become ``PerReplica``
        values holding all replicas' values (mirrored values and variables are passed
        as themselves). ``merge_fn`` runs there alone; its result is broadcast and
        replica ``i`` receives component ``i`` of each ``PerReplica`` leaf in it. With
        ``merge_call="every_rank"`` it runs on every rank with this rank's own values
        and reductions inside it are collectives (see :mod:`mpistrat.distribute.merge`). An
        exception in ``merge_fn`` is raised on every rank.

        >>> import mpistrat
        >>> ctx = mpistrat.get_replica_context()
        >>> ctx.merge_call(lambda strategy, x: x + 1, args=(41,))
        42
        """
        in_turn = self._in_turn
        if in_turn is not None and modes.current_mode().replica_context is self:
            return in_turn.merge_call(merge_fn, args, dict(kwargs or {}))  # strategy.run inside a merge_fn
        self._require_current("merge_call")
        return self._strategy.extended.call_merge_fn(merge_fn, args, dict(kwargs or {}))

    def _update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """``fn(v, *args, **kwargs)`` on this replica's copy ``v`` of ``var``, without merge_call: tf's
        ``ReplicaContext._update`` (``strategy.extended.update`` called in replica context)."""
        self._require_current("_update")
        return self._strategy.extended.update(var, fn, args, kwargs, group)

    def _require_current(self, method: str) -> None:
        mode = modes.require_replica(f"ReplicaContext.{method}")  # nor strategy.run inside a merge_fn
        if mode.replica_context is not self:
            raise ContextError(
                f"ReplicaContext.{method} called on a replica context that is not the current one; "
                "use mpistrat.get_replica_context()"
            )

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )
