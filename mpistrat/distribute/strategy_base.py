"""Strategy: a group of replicas and how to compute on them, as ``tf.distribute.Strategy``.

The concrete strategies are :class:`~mpistrat.MPIStrategy` and
:class:`~mpistrat.MultiWorkerMirroredStrategy` (``strategy.py``) and the default
single-replica one (``default.py``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from mpistrat import nest, values
from mpistrat.distribute import reductions, results
from mpistrat.distribute.extended import StrategyExtended
from mpistrat.distribute.replica_context import ReplicaContext
from mpistrat.errors import ContextError, UnsupportedTypeError
from mpistrat.interface import modes
from mpistrat.reduce_op import ReduceOp
from mpistrat.values import Mirrored, PerReplica

if TYPE_CHECKING:
    from mpistrat.distribute.cluster_resolver import ClusterResolver
    from mpistrat.input import datasets as _datasets
    from mpistrat.input.contexts import InputContext, InputOptions, InputReplicationMode, ValueContext

__all__ = ["Strategy"]

_MIXING = "Mixing different tf.distribute.Strategy objects: a scope of another strategy is already active"


class _Scope:
    """What ``Strategy.scope()`` returns: each ``with`` opens a new block, so it may be re-entered."""

    __slots__ = ("_make", "_open")

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager[Strategy]]):
        self._make = make
        self._open: list[contextlib.AbstractContextManager[Strategy]] = []

    def __enter__(self) -> Strategy:
        block = self._make()
        entered = block.__enter__()
        self._open.append(block)
        return entered

    def __exit__(self, *exc_info: Any) -> bool | None:
        return self._open.pop().__exit__(*exc_info)


class Strategy:
    """A group of replicas and how to compute on them, as ``tf.distribute.Strategy``."""

    def __init__(self, extended: StrategyExtended):
        self._extended = extended
        # What its datasets are handed: they outlive a finalize, and say so when next used.
        self._collectives = extended.collectives

    @property
    def extended(self) -> StrategyExtended:
        """The :class:`StrategyExtended` with additional methods."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas over which gradients are aggregated (the number of ranks)."""
        return self._extended.size

    @property
    def cluster_resolver(self) -> ClusterResolver | None:
        """The cluster: None for the default strategy, as in tf (MPI strategies override it)."""
        return None

    def _require_own(self, method: str) -> None:
        """Raise, as tf does, when another strategy's scope is active (the default context is fine)."""
        mode = modes.current_mode()
        if mode.kind is not modes.DEFAULT and mode.strategy is not self:
            raise ContextError(
                f"{method}: Mixing different tf.distribute.Strategy objects: {mode.strategy} is not {self}"
            )

    def scope(self) -> _Scope:
        """Select this strategy and enter its cross-replica context.

        The object may be entered again after it was left, and nested in itself, as tf's.

        >>> import mpistrat
        >>> strategy = mpistrat.MPIStrategy()
        >>> with strategy.scope():
        ...     assert mpistrat.get_strategy() is strategy
        """
        return _Scope(self._scope)

    @contextlib.contextmanager
    def _scope(self) -> Iterator[Strategy]:
        mode = modes.current_mode()
        if mode.kind is not modes.DEFAULT:
            if mode.strategy is not self:
                raise ContextError(_MIXING)  # a RuntimeError, as tf's
            modes.require_cross_replica("Strategy.scope")
        self._extended.collectives  # noqa: B018 (raises if finalized)
        if mode.kind is modes.MERGE:  # inside merge_fn (rank 0 alone) the scope is already entered:
            yield self  # keep the merge context, or rank 0 would enter collectives alone
            return
        with self._enter_scope(mode):
            yield self

    def _enter_scope(self, mode: modes.Mode) -> contextlib.AbstractContextManager[Any]:
        """What entering the scope pushes: this strategy's SPMD cross-replica mode."""
        return modes.push(modes.Mode(self, None, modes.CROSS_REPLICA, modes.in_default_scope()))

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        options: Any = None,
    ) -> Any:
        """Call ``fn(*args, **kwargs)`` once on each rank, in that replica's context.

        ``PerReplica`` arguments are unwrapped to this replica's component. Returns
        this rank's result as is (one replica per rank).

        >>> import mpistrat
        >>> strategy = mpistrat.MPIStrategy()
        >>> def replica_id():
        ...     return mpistrat.get_replica_context().replica_id_in_sync_group
        >>> strategy.run(replica_id) == strategy.extended.rank
        True
        """
        mode = modes.require_cross_replica("Strategy.run")
        if mode.kind is modes.MERGE:
            return self._run_in_merge_fn(mode, fn, tuple(args), dict(kwargs or {}))
        if mode.kind is not modes.DEFAULT and mode.strategy is not self:
            raise ContextError(_MIXING)  # a RuntimeError, as tf's
        collectives = self._extended.collectives  # raises if finalized
        rank = self._extended.rank
        args = self._unwrap(tuple(args), rank) if args else ()
        kwargs = self._unwrap(dict(kwargs), rank) if kwargs else {}
        if collectives.size == 1:  # one replica: nothing to regroup, no one to tell
            with ReplicaContext(self, rank):
                result = fn(*args, **kwargs)
        else:
            failures = collectives.failures
            try:
                with ReplicaContext(self, rank):  # its replica mode is the current mode; none reads below it
                    result = fn(*args, **kwargs)
            except Exception as exc:
                # An error out of a collective inside fn is not shared: one that failed on every rank told
                # everyone already (a rank that raised early met the others there), and after a timeout or
                # a failed transfer the others may be anywhere. A closing handshake would wait for nobody.
                # Under MPISTRAT_CHECK=step the others may be in a collective that sends no handshake,
                # which this one would pair with: the error leaves this rank alone, as with the check off.
                if collectives.failures == failures and collectives.step_check is None:
                    results.agree_on_result(collectives, None, exc)
                raise
            results.agree_on_result(collectives, result, None)
        if collectives.after_step:  # a background save to put in place once every rank wrote its share
            collectives.step_ended()
        return result

    experimental_run_v2 = run

    def _run_in_merge_fn(
        self, mode: modes.Mode, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``run`` inside a root-mode merge_fn: rank 0 holds every replica's arguments, so it calls
        ``fn`` once per replica, in turn, as tf's MirroredStrategy does; a ``PerReplica`` of the results.

        Each call is in that replica's context, but on rank 0 alone: communicating, or touching a
        copy of a variable that another rank holds, raises ContextError (see ``modes.Mode``); a
        ``merge_call`` inside waits for every replica's (see :mod:`mpistrat.distribute.in_turn`).
        """
        from mpistrat.distribute import in_turn  # a root-mode merge_fn that calls run: few jobs

        size = self.num_replicas_in_sync
        calls = [(self._unwrap(args, r), self._unwrap(kwargs, r)) for r in range(size)]
        results = in_turn.run_in_turn(self, fn, calls)
        if size == 1:
            return results[0]
        try:  # PerReplica leaves in the results' common structure, as tf's regroup gives
            return nest.tree_map(lambda *xs: PerReplica(xs), *results)
        except ValueError:
            return PerReplica(tuple(results))

    def experimental_run(self, fn: Callable[..., Any], input_iterator: Any = None) -> Any:
        """Call ``fn`` on each rank with its part of the next input, as tf.distribute's older ``run``.

        ``fn(input_iterator.get_next())``, or ``fn()`` without an iterator, in the
        replica context; returns this rank's result. The iterator is one from
        :meth:`make_dataset_iterator` or :meth:`make_input_fn_iterator`.

        >>> import mpistrat, numpy as np
        >>> strategy = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
        >>> iterator = strategy.make_dataset_iterator([np.arange(4)])
        >>> _ = iterator.initialize()
        >>> int(strategy.experimental_run(lambda batch: batch.sum(), iterator))
        6
        """
        if input_iterator is None:
            return self.run(fn)
        return self.run(fn, args=(input_iterator.get_next(),))

    def _unwrap(self, arguments: Any, rank: int) -> Any:
        """``arguments`` with PerReplica/Mirrored leaves replaced by this rank's component.

        Rebuilt only when there is something to unwrap: the user's objects pass through as
        they are, and a large argument nest costs one flatten in C (arguments that are arrays and
        numbers, none).
        """
        values = arguments.values() if type(arguments) is dict else arguments
        if nest.LEAF_TYPES.issuperset(map(type, values)):
            return arguments
        leaves, spec = nest.tree_flatten(arguments)
        if not any(isinstance(leaf, (PerReplica, Mirrored)) for leaf in leaves):
            return arguments
        import optree  # loaded already: it flattened them

        return optree.tree_unflatten(spec, [self._local_component(leaf, rank) for leaf in leaves])

    def _local_component(self, value: Any, rank: int) -> Any:
        return values.component(value, rank, self.num_replicas_in_sync, "run")

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduce a per-replica value (or a nest of them) across replicas.

        With ``axis``, each replica's value is first reduced along it; MEAN then
        divides by the number of elements along ``axis`` over all replicas, so
        uneven batches give the exact global mean. MEAN keeps a float dtype
        (integers give float64); a variable counts as this rank's copy of it.

        >>> import mpistrat, numpy as np
        >>> strategy = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
        >>> strategy.reduce("mean", np.array([1.0, 2.0, 6.0], np.float32), axis=0)
        np.float32(3.0)
        """
        mode = modes.require_cross_replica("Strategy.reduce")
        self._require_own("Strategy.reduce")
        return self._extended.reducer(mode).reduce(reduce_op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate the replicas' values along ``axis`` (cross-replica context).

        >>> import mpistrat, numpy as np
        >>> mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF).gather(np.array([1, 2]), axis=0)
        array([1, 2])
        """
        mode = modes.require_cross_replica("Strategy.gather")
        self._require_own("Strategy.gather")
        return self._extended.reducer(mode).gather(value, axis)

    # -- input: thin delegations to mpistrat.input (its datasets imported by the first one made) ----

    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> _datasets.DistributedDataset:
        """Split each global batch of ``dataset`` across the replicas, in rank order.

        Every rank iterates ``dataset`` itself, so it must yield the same global
        batches on every rank. See ``docs/input.md``.

        >>> import mpistrat, numpy as np
        >>> strategy = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
        >>> [x.tolist() for x in strategy.experimental_distribute_dataset([np.arange(3)])]
        [[0, 1, 2]]
        """
        self._require_own("experimental_distribute_dataset")
        from mpistrat.input import datasets as _datasets

        return _datasets.distribute_dataset(self._collectives, dataset, options, self)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None = None
    ) -> _datasets.DistributedDatasetsFromFunction:
        """One input pipeline per rank: ``dataset_fn(InputContext)`` yields this replica's batches.

        Collective. Pipelines may differ in length; ``InputOptions.uneven`` says what
        happens when some run out first (default: empty batches, nothing lost).
        """
        self._require_own("distribute_datasets_from_function")
        from mpistrat.input import datasets as _datasets

        return _datasets.distribute_datasets_from_function(self._collectives, dataset_fn, options, owner=self)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def make_dataset_iterator(self, dataset: Iterable[Any]) -> _datasets.InputIterator:
        """An iterator (``initialize()``, ``get_next()``) over ``dataset``'s global batches, split."""
        self._require_own("make_dataset_iterator")
        from mpistrat.input import datasets as _datasets

        return _datasets.make_dataset_iterator(self._collectives, dataset, self)

    def make_input_fn_iterator(
        self,
        input_fn: Callable[[InputContext], Iterable[Any]],
        replication_mode: InputReplicationMode | str = "PER_WORKER",
    ) -> _datasets.InputIterator:
        """An iterator (``initialize()``, ``get_next()``) over one ``input_fn`` pipeline per rank."""
        self._require_own("make_input_fn_iterator")
        from mpistrat.input import datasets as _datasets

        return _datasets.make_input_fn_iterator(self._collectives, input_fn, replication_mode, self)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """This replica's ``value_fn(ValueContext(rank, num_replicas))``, to pass to ``run``."""
        from mpistrat.input.contexts import distribute_values_from_function

        return distribute_values_from_function(self._collectives, value_fn)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values held by this process: every component of a ``DistributedValues``, else ``(value,)``."""
        return reductions.local_results(value)

    def experimental_initialize(self) -> list[Any]:
        """Nothing to initialize on MPI (the communicator is ready); returns ``[]``."""
        return []

    def experimental_finalize(self) -> list[Any]:
        """Free the private communicator (collective). Using the strategy afterwards raises."""
        if modes.current_mode().kind is modes.MERGE:
            raise ContextError(
                "experimental_finalize() cannot be called inside merge_fn: it runs on rank 0 alone and "
                "finalizing is collective; call it in cross-replica context on every rank"
            )
        self._extended.finalize()
        return []

    def update_config_proto(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``config`` set up for this rank.

        Sets ``device_filters`` to this rank's worker task, and
        ``experimental.collective_group_leader`` to task 0, as a multi-worker
        tf.distribute strategy does; the input is not modified.

        >>> import mpistrat
        >>> mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF).update_config_proto({})["device_filters"]
        ['/job:worker/task:0']
        """
        if not isinstance(config, Mapping):
            raise UnsupportedTypeError(
                f"update_config_proto: expected a mapping; got {type(config).__name__}"
            )
        updated = copy.deepcopy(dict(config))
        updated["device_filters"] = [f"/job:worker/task:{self._extended.rank}"]
        experimental = dict(updated.get("experimental", {}))
        experimental["collective_group_leader"] = "/job:worker/replica:0/task:0"
        updated["experimental"] = experimental
        return updated

    def __deepcopy__(self, memo: dict[int, Any]) -> Strategy:
        # A strategy owns a communicator; copies of objects that refer to it share it.
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync})"
