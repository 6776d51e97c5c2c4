"""ReplicaContext: the API available inside ``strategy.run(fn)``."""

from __future__ import annotations

import collections
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import optree

from mpistrat import context
from mpistrat.collectives import Unsendable
from mpistrat.errors import ContextError, MergeCallError, UnsupportedTypeError
from mpistrat.options import CommunicationOptions
from mpistrat.reduce_op import ReduceOp
from mpistrat.values import DistributedValues, Mirrored, PerReplica

if TYPE_CHECKING:
    from mpistrat.strategy import Strategy

__all__ = ["ReplicaContext"]

_NEST = {"none_is_leaf": True, "namespace": "mpistrat"}

# PerReplica components in a merge_fn result, as a node optree walks into (so arrays inside
# travel as raw buffers); each rank keeps its own component.
_Parts = collections.namedtuple("_Parts", "values")


class _SameEverywhere:
    """Stands in for a value every rank already holds (a mirrored value or variable)."""


# A distributed variable in a merge_fn result: each rank takes its own object with that key.
_Synced = collections.namedtuple("_Synced", "key")


class ReplicaContext:
    """One replica's view: this rank, its id, and collectives with the other replicas.

    >>> import mpistrat
    >>> ctx = mpistrat.get_replica_context()  # the default single-replica context
    >>> ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync
    (0, 1)
    >>> ctx.all_reduce("sum", {"a": 1.0})
    {'a': np.float64(1.0)}
    """

    def __init__(self, strategy: Strategy, replica_id_in_sync_group: int):
        self._strategy = strategy
        self._replica_id = int(replica_id_in_sync_group)
        self._modes: list[Any] = []

    def __enter__(self) -> ReplicaContext:
        push = context.push(context.Mode(self._strategy, self, "replica"))
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
        """Run ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        Every rank's ``args``/``kwargs`` are gathered to rank 0, where array and
        differing leaves become ``PerReplica`` values holding all replicas' values
        (mirrored values and variables are passed as themselves). ``merge_fn`` runs
        there alone; its result is broadcast and ``PerReplica`` leaves in it are
        unpacked, replica ``i`` getting component ``i``. An exception in ``merge_fn``
        is raised on every rank.

        >>> import mpistrat
        >>> ctx = mpistrat.get_replica_context()
        >>> ctx.merge_call(lambda strategy, x: x + 1, args=(41,))
        42
        """
        self._require_current("merge_call")
        kwargs = dict(kwargs or {})
        strategy = self._strategy
        if strategy.extended.is_default:
            with context.push(context.Mode(strategy, None, "merge")):
                return merge_fn(strategy, *args, **kwargs)
        return _merge_call_mpi(strategy, self._replica_id, merge_fn, args, kwargs)

    def _require_current(self, method: str) -> None:
        mode = context.require_replica(f"ReplicaContext.{method}")
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


def _merge_call_mpi(
    strategy: Strategy, rank: int, merge_fn: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    extended = strategy.extended
    collectives = extended.collectives
    local = (tuple(args), kwargs)
    gathered = collectives.gather_to_root(optree.tree_map(_strip_shared, local, **_NEST))
    payload: Any = None
    if rank == 0:
        try:
            m_args, m_kwargs = _regroup(local, gathered)
            extended.merge_writes = []
            with context.push(context.Mode(strategy, None, "merge")):
                result = merge_fn(strategy, *m_args, **m_kwargs)
            payload = ("ok", optree.tree_map(_split_per_replica, result, **_NEST), extended.merge_writes)
        except BaseException as exc:  # every rank must hear of it, whatever it is
            payload = ("error", _portable(exc))
            original = exc
        finally:
            extended.merge_writes = None
    status, *rest = collectives.broadcast_from_root(payload)
    if status == "error":
        if rank == 0:
            raise original
        raise rest[0]
    result, writes = rest
    if rank != 0:
        extended.apply_merge_writes(writes)
    return optree.tree_map(
        lambda x: _take_component(x, rank, extended),
        result,
        is_leaf=lambda x: isinstance(x, (_Parts, _Synced)),
        **_NEST,
    )


def _strip_shared(leaf: Any) -> Any:
    if isinstance(leaf, DistributedValues) and not isinstance(leaf, PerReplica):
        return _SameEverywhere()
    return leaf


def _regroup(local: Any, gathered: list[Any]) -> Any:
    """Rank 0's args with each leaf replaced by ``PerReplica`` of every rank's value."""
    leaves, spec = optree.tree_flatten(local, **_NEST)
    per_rank = [leaves]
    for r, other in enumerate(gathered[1:], start=1):
        if isinstance(other, Unsendable):
            raise UnsupportedTypeError(f"rank {r}: {other.message}")
        other_leaves, other_spec = optree.tree_flatten(other, **_NEST)
        if other_spec != spec:
            raise UnsupportedTypeError(
                f"merge_call: rank {r} passed arguments of a different structure than rank 0 "
                f"({other_spec} vs {spec}); every replica must pass the same structure"
            )
        per_rank.append(other_leaves)
    merged = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, DistributedValues) and not isinstance(leaf, PerReplica):
            merged.append(leaf)
            continue
        values = [r[i] for r in per_rank]
        if _is_data(leaf) or not _all_equal(values):
            merged.append(PerReplica(values))
        else:
            merged.append(leaf)
    return optree.tree_unflatten(spec, merged)


def _is_data(leaf: Any) -> bool:
    return isinstance(leaf, (np.ndarray, np.generic)) or type(leaf).__module__.startswith("cupy")


def _all_equal(values: list[Any]) -> bool:
    first = values[0]
    try:
        return all(type(v) is type(first) and bool(v == first) for v in values[1:])
    except Exception:
        return False


def _split_per_replica(leaf: Any) -> Any:
    if isinstance(leaf, PerReplica):
        return _Parts(tuple(leaf.values))
    if isinstance(leaf, Mirrored):  # each replica gets the value, as tf's select_replica does
        return _Parts(leaf.values[:1])
    key = getattr(leaf, "_synced_key", None)
    if isinstance(leaf, DistributedValues) and key is not None:
        return _Synced(key)
    return leaf


def _take_component(leaf: Any, rank: int, extended: Any) -> Any:
    if isinstance(leaf, _Synced):
        return extended.synced(leaf.key)
    if not isinstance(leaf, _Parts):
        return leaf
    if len(leaf.values) == 1:
        return leaf.values[0]
    return leaf.values[rank]


def _portable(exc: BaseException) -> BaseException:
    """The exception itself if it survives pickling, else a ``MergeCallError`` that says what it was."""
    try:
        clone = pickle.loads(pickle.dumps(exc))
        if type(clone) is type(exc) and str(clone) == str(exc):
            return exc
    except Exception:
        pass
    return MergeCallError(f"merge_fn raised {type(exc).__module__}.{type(exc).__qualname__}: {exc}")
