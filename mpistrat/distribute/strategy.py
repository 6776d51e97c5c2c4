"""Strategy and MPIStrategy: one MPI rank per replica."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import optree
from mpi4py import MPI

from mpistrat import config, context, nest, values
from mpistrat.comm import packing
from mpistrat.diagnostics import abort, watchdog
from mpistrat.distribute import cluster_resolver as _resolvers
from mpistrat.distribute import merge
from mpistrat.distribute.extended import StrategyExtended
from mpistrat.distribute.replica_context import ReplicaContext
from mpistrat.errors import ContextError, InvalidArgumentError, MpistratError, UnsupportedTypeError
from mpistrat.input import datasets as _datasets
from mpistrat.input.contexts import (
    InputContext,
    InputOptions,
    InputReplicationMode,
    ValueContext,
    distribute_values_from_function,
)
from mpistrat.options import CommunicationOptions
from mpistrat.reduce_op import ReduceOp
from mpistrat.values import DistributedValues, Mirrored, PerReplica

__all__ = ["Strategy", "MPIStrategy", "MultiWorkerMirroredStrategy", "default_strategy"]


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

    @property
    def extended(self) -> StrategyExtended:
        """The :class:`StrategyExtended` with additional methods."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas over which gradients are aggregated (the number of ranks)."""
        return self._extended.size

    @property
    def cluster_resolver(self) -> _resolvers.ClusterResolver | None:
        """The cluster: None for the default strategy, as in tf (MPI strategies override it)."""
        return None

    def _require_own(self, method: str) -> None:
        """Raise, as tf does, when another strategy's scope is active (the default context is fine)."""
        mode = context.current_mode()
        if mode.kind != "default" and mode.strategy is not self and not self._extended.is_default:
            raise ContextError(f"{method}: Mixing different Strategy objects: {mode.strategy} is not {self}")

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
        mode = context.current_mode()
        if mode.kind != "default":
            if mode.strategy is not self:
                raise ContextError(  # a RuntimeError, as tf's
                    "Mixing different Strategy objects: a scope of another strategy is already active"
                )
            context.require_cross_replica("Strategy.scope")
        self._extended.collectives  # noqa: B018 (raises if finalized)
        if self._extended.is_default and mode.kind == "default":
            with context.default_scope():  # as tf: it keeps its default replica context
                yield self
            return
        if mode.kind == "merge":  # inside merge_fn (rank 0 alone) the scope is already entered:
            yield self  # keep the merge context, or rank 0 would enter collectives alone
            return
        with context.push(context.Mode(self, None, "cross_replica", context.in_default_scope())):
            yield self

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
        mode = context.require_cross_replica("Strategy.run")
        if mode.kind == "merge" and not self._extended.is_default:
            return self._run_on_root(fn, tuple(args), dict(kwargs or {}))
        if mode.kind != "default" and mode.strategy is not self:
            raise ContextError(  # a RuntimeError, as tf's
                "Mixing different Strategy objects: a scope of another strategy is already active"
            )
        self._extended.collectives  # noqa: B018 (raises if finalized)
        rank = self._extended.rank
        args = self._unwrap(tuple(args), rank) if args else ()
        kwargs = self._unwrap(dict(kwargs), rank) if kwargs else {}
        with ReplicaContext(self, rank):  # its replica mode is the current mode; nothing reads below it
            return fn(*args, **kwargs)

    experimental_run_v2 = run

    def _run_on_root(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``run`` inside a root-mode merge_fn: rank 0 holds every replica's arguments, so it calls
        ``fn`` once per replica, in turn, as tf's MirroredStrategy does; a ``PerReplica`` of the results.

        Each call is in that replica's context, but on rank 0 alone: communicating, or touching a
        copy of a variable that another rank holds, raises ContextError (see ``context.Mode``).
        """
        size = self.num_replicas_in_sync
        results = []
        for replica in range(size):
            a = self._unwrap(args, replica)
            kw = self._unwrap(kwargs, replica)
            with context.push(context.Mode(self, ReplicaContext(self, replica), "merge")):
                results.append(fn(*a, **kw))
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
        they are, and a large argument nest costs one flatten in C.
        """
        leaves, spec = nest.tree_flatten(arguments)
        if not any(isinstance(leaf, (PerReplica, Mirrored)) for leaf in leaves):
            return arguments
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
        mode = context.require_cross_replica("Strategy.reduce")
        self._require_own("Strategy.reduce")
        if mode.kind == "merge":
            op = ReduceOp.from_any(reduce_op)
            return merge.reduce_here(op, value, self.num_replicas_in_sync, "reduce", axis)
        collectives = self._extended.collectives
        rank, size = self._extended.rank, self.num_replicas_in_sync
        try:
            op = ReduceOp.from_any(reduce_op)
            local = nest.tree_map(lambda x: values.component(x, rank, size, "reduce"), value)
        except MpistratError as exc:
            collectives.agree("reduce", error=exc)  # the others are entering the all_reduce: tell them
            raise
        if axis is None:
            return collectives.all_reduce(op, local, kind="reduce")
        # Exact with CommunicationOptions(deterministic=True): the same bits at any number of ranks.
        return collectives.reduce_along_axis(op, local, axis, kind="reduce")

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate the replicas' values along ``axis`` (cross-replica context).

        >>> import mpistrat, numpy as np
        >>> mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF).gather(np.array([1, 2]), axis=0)
        array([1, 2])
        """
        mode = context.require_cross_replica("Strategy.gather")
        self._require_own("Strategy.gather")
        if mode.kind == "merge":
            return nest.tree_map(
                lambda v: _concatenate(self.experimental_local_results(v), axis),
                value,
            )
        local = nest.tree_map(lambda x: self._local_component(x, self._extended.rank), value)
        return self._extended.collectives.all_gather(local, axis, kind="gather")

    # -- input: thin delegations to mpistrat.input ------------------------------------

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
        return _datasets.distribute_dataset(self, dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None = None
    ) -> _datasets.DistributedDatasetsFromFunction:
        """One input pipeline per rank: ``dataset_fn(InputContext)`` yields this replica's batches.

        Collective. Pipelines may differ in length; ``InputOptions.uneven`` says what
        happens when some run out first (default: empty batches, nothing lost).
        """
        self._require_own("distribute_datasets_from_function")
        return _datasets.distribute_datasets_from_function(self, dataset_fn, options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def make_dataset_iterator(self, dataset: Iterable[Any]) -> _datasets.InputIterator:
        """An iterator (``initialize()``, ``get_next()``) over ``dataset``'s global batches, split."""
        self._require_own("make_dataset_iterator")
        return _datasets.make_dataset_iterator(self, dataset)

    def make_input_fn_iterator(
        self,
        input_fn: Callable[[InputContext], Iterable[Any]],
        replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER,
    ) -> _datasets.InputIterator:
        """An iterator (``initialize()``, ``get_next()``) over one ``input_fn`` pipeline per rank."""
        self._require_own("make_input_fn_iterator")
        return _datasets.make_input_fn_iterator(self, input_fn, replication_mode)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """This replica's ``value_fn(ValueContext(rank, num_replicas))``, to pass to ``run``."""
        return distribute_values_from_function(self, value_fn)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values held by this process: every component of a ``DistributedValues``, else ``(value,)``."""
        if isinstance(value, DistributedValues):
            return value.values
        return (value,)

    def experimental_initialize(self) -> list[Any]:
        """Nothing to initialize on MPI (the communicator is ready); returns ``[]``."""
        return []

    def experimental_finalize(self) -> list[Any]:
        """Free the private communicator (collective). Using the strategy afterwards raises."""
        if context.current_mode().kind == "merge":
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


class MPIStrategy(Strategy):
    """Synchronous data parallelism with one replica per MPI rank.

    >>> import mpistrat
    >>> strategy = mpistrat.MPIStrategy()  # every rank of COMM_WORLD is a replica
    >>> strategy.num_replicas_in_sync == mpistrat.MPI.COMM_WORLD.Get_size()
    True

    Args:
        comm: the intracommunicator whose ranks are the replicas (default
            ``MPI.COMM_WORLD``); the strategy talks on a private duplicate of it.
            Creating the strategy is collective over ``comm``.
        communication_options: defaults for every collective.
        merge_call: where ``ReplicaContext.merge_call`` runs ``merge_fn``: ``"root"``
            (gather to rank 0, run once, broadcast; any merge_fn) or ``"every_rank"``
            (every rank runs it on its own values; reductions inside are collectives,
            so the variable-update pattern costs one all-reduce at any scale). See
            :mod:`mpistrat.distribute.merge`. The optimizers use ``"every_rank"`` either way.
    """

    def __init__(
        self,
        comm: MPI.Intracomm | None = None,
        *,
        communication_options: CommunicationOptions | None = None,
        merge_call: str = "root",
    ):
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise UnsupportedTypeError(f"MPIStrategy: comm must be an mpi4py intracommunicator; got {comm!r}")
        if merge_call not in merge.MODES:
            raise InvalidArgumentError(
                f"MPIStrategy: merge_call must be 'root' or 'every_rank'; got {merge_call!r}"
            )
        options = CommunicationOptions().merge(communication_options)
        abort.install()  # an uncaught exception on one rank now ends the job, not just that rank
        timeout = options.timeout_seconds or config.read("MPISTRAT_TIMEOUT")
        private = watchdog.duplicate(comm, timeout) if comm.Get_size() > 1 else comm.Dup()
        super().__init__(StrategyExtended(self, private, options, merge_call=merge_call))
        self._cluster_resolver: _resolvers.ClusterResolver | None = None

    @property
    def cluster_resolver(self) -> _resolvers.ClusterResolver:
        """This rank's place in the cluster: ``task_type="worker"``, ``task_id`` the rank.

        ``cluster_spec()`` has one ``"worker"`` address per rank: its host name (from MPI) and a
        port that means nothing (MPI connects the ranks). See :mod:`mpistrat.cluster_resolver`.

        >>> import mpistrat
        >>> resolver = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF).cluster_resolver
        >>> resolver.task_type, resolver.task_id, resolver.cluster_spec().num_tasks("worker")
        ('worker', 0, 1)
        """
        if self._cluster_resolver is None:
            extended = self._extended
            placement = extended.placement
            self._cluster_resolver = _resolvers.MPIClusterResolver(
                extended.rank, placement.hosts, placement.gpu
            )
        return self._cluster_resolver


class MultiWorkerMirroredStrategy(MPIStrategy):
    """tf's ``MultiWorkerMirroredStrategy``: every rank of ``MPI.COMM_WORLD`` is a worker with one replica.

    It is :class:`MPIStrategy` over ``COMM_WORLD`` with ``merge_call="every_rank"``: as on tf's
    workers, ``merge_fn`` runs on every rank with its own values and reductions inside it are
    collectives. Creating it is collective.

    >>> import mpistrat
    >>> strategy = mpistrat.MultiWorkerMirroredStrategy()
    >>> strategy.cluster_resolver.task_type
    'worker'

    Args:
        cluster_resolver: None (MPI says who the workers are), or a resolver (a
            :class:`~mpistrat.cluster_resolver.SlurmClusterResolver`, ``TFConfig...``,
            ``Simple...``) that must describe this MPI job: as many chief and worker tasks as
            ranks, and this rank's task at its rank (the chief first). Otherwise every rank
            raises ``InvalidArgumentError``. MPI is used either way; ``cluster_resolver``
            returns the resolver given.
        communication_options: a :class:`~mpistrat.CommunicationOptions`, defaults for every
            collective.
    """

    def __init__(
        self,
        cluster_resolver: _resolvers.ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
    ):
        if cluster_resolver is not None:
            _check_resolver(cluster_resolver)
        super().__init__(MPI.COMM_WORLD, communication_options=communication_options, merge_call="every_rank")
        if cluster_resolver is not None:
            self._cluster_resolver = cluster_resolver


def _check_resolver(resolver: Any) -> None:
    """Every rank raises unless ``resolver`` describes COMM_WORLD (collective, on a private duplicate)."""
    problem = ""
    try:
        if not isinstance(resolver, _resolvers.ClusterResolver):
            raise UnsupportedTypeError(
                "MultiWorkerMirroredStrategy: cluster_resolver must be an mpistrat.cluster_resolver."
                f"ClusterResolver or None; got {type(resolver).__name__}"
            )
        index, count, problem = _resolvers.worker_index(resolver)
    except (MpistratError, ValueError, TypeError, RuntimeError, KeyError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    comm = MPI.COMM_WORLD.Dup()
    try:
        rank, size = comm.Get_rank(), comm.Get_size()
        if not problem and count != size:
            problem = f"it describes {count} chief and worker tasks, but MPI started {size} ranks"
        elif not problem and index != rank:
            problem = (
                f"its task ({resolver.task_type!r}, {resolver.task_id}) is task {index} of the cluster, but "
                f"this is MPI rank {rank}"
            )
        problems = comm.allgather(problem)
    finally:
        comm.Free()
    bad: dict[str, list[int]] = {}
    for r, p in enumerate(problems):
        if p:
            bad.setdefault(p, []).append(r)
    if bad:
        where = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {p}" for p, rs in bad.items()
        )
        raise InvalidArgumentError(
            "MultiWorkerMirroredStrategy: the cluster_resolver does not describe this MPI job ("
            + where
            + "). "
            "MPI decides the workers: launch as many ranks as the resolver has tasks (srun gives each its "
            "SLURM_PROCID as its rank), or pass no cluster_resolver"
        )


class _DefaultStrategy(Strategy):
    """The single-replica strategy in effect outside any scope."""

    def __init__(self) -> None:
        super().__init__(StrategyExtended(self, MPI.COMM_SELF, CommunicationOptions(), is_default=True))


def _concatenate(components: Any, axis: int) -> Any:
    xp = packing.common_module(components)
    return xp.concatenate([xp.asarray(c) for c in components], axis=axis)


@functools.lru_cache(maxsize=1)
def default_strategy() -> Strategy:
    """The default single-replica strategy (what ``get_strategy()`` returns outside a scope)."""
    return _DefaultStrategy()


context.set_default_strategy(default_strategy)
