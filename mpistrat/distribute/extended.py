"""StrategyExtended: the communicator, devices and lower-level APIs behind a Strategy.

Two cross-replica contexts meet here. In the SPMD one (inside ``strategy.scope()``,
every rank executing) ``reduce_to`` and ``batch_reduce_to`` are MPI collectives
over each rank's local value. In a ``merge_fn`` (rank 0 alone, ``PerReplica``
arguments holding every replica's value) they are local array arithmetic, and
writes to variables travel back with merge_call's broadcast. Each method checks its
arguments, then hands them to the one of the two (``reductions.py``) that ``_reductions``
picks. The default strategy's extended is a subclass (``default.py``).

>>> import mpistrat, numpy as np
>>> strategy = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
>>> with strategy.scope():
...     v = mpistrat.Variable(1.0)
...     total = strategy.extended.reduce_to("sum", np.float64(2.0), destinations=v)
...     _ = strategy.extended.update(v, lambda var, t: var.assign_add(t), args=(total,))
>>> float(v.numpy())
3.0
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from mpistrat.collectives import FREED, Collectives
from mpistrat.comm import devices
from mpistrat.diagnostics import watchdog
from mpistrat.diagnostics.stragglers import Stragglers
from mpistrat.distribute import reductions
from mpistrat.distribute.reductions import LocalReducer, SpmdReducer
from mpistrat.distribute.replica_context import ReplicaContext
from mpistrat.errors import ContextError, InvalidArgumentError
from mpistrat.interface import modes
from mpistrat.interface.protocols import SyncedWrites
from mpistrat.options import CommunicationOptions
from mpistrat.values import HasLocalCopy, local_variable

if TYPE_CHECKING:
    from mpistrat.distribute.strategy_base import Strategy

__all__ = ["StrategyExtended"]

_numbers = itertools.count(1)  # strategies made in this process, for their names in flight records


class StrategyExtended:
    """Additional APIs for algorithms that need to be distribution-aware.

    Owns the strategy's private communicator (a duplicate, so mpistrat's messages
    never meet the application's) and its :class:`~mpistrat.collectives.Collectives`.
    """

    def __init__(
        self,
        container_strategy: Strategy,
        comm: MPI.Intracomm,
        options: CommunicationOptions,
        *,
        merge_call: str = "root",
    ):
        name = f"{type(container_strategy).__name__} #{next(_numbers)}"  # as its flight records say
        self._setup(container_strategy, comm, options, merge_call, name)
        # The private communicator is freed when the Collectives using it are collected, so a
        # program may drop strategies without experimental_finalize() and not run out of them.
        c = self._collectives
        release = weakref.finalize(c, watchdog.release, c.monitor, comm, c.closer())
        release.atexit = False  # MPI_Finalize frees what is left at exit
        self._release: weakref.finalize | None = release
        # This rank's device: node-local rank modulo the visible GPUs (collective; see comm/devices.py).
        self.placement = devices.place(comm)
        c.locate(self.placement.hosts, self.placement.processes)  # diagnoses name hosts; deaths seen
        # The two cross-replica contexts' reductions (see _reductions).
        self._spmd = SpmdReducer(self)
        self._local = LocalReducer(self.size, options, reductions.mirrored(self.size))

    def _setup(
        self,
        container_strategy: Strategy,
        comm: MPI.Intracomm,
        options: CommunicationOptions,
        merge_call: str,
        name: str,
    ) -> None:
        """What every strategy's extended holds (the default strategy's too); ``name`` labels its
        flight records."""
        self._container_strategy = container_strategy
        self._comm: MPI.Intracomm | None = comm
        self._options = options
        self._collectives = Collectives(comm, options, name)
        self._release = None
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.merge_call_mode = merge_call  # "root" or "every_rank" (see mpistrat.distribute.merge)
        # What cross-replica writes to this strategy's variables do now (inside a merge_fn, inside
        # update()): its variables are handed it at creation, merge_call and update set it.
        self.writes = SyncedWrites()
        # Weak, so variables a program drops are freed; keys come from a counter, never reused.
        self._synced: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._synced_keys = itertools.count()
        # variable_created_in_scope: what distribute_strategy says of variables created in the scope
        self._scope_owner: Strategy | None = container_strategy

        self.default_replica_context: ReplicaContext = ReplicaContext(container_strategy, 0)

    @property
    def collectives(self) -> Collectives:
        if self._comm is None:
            raise ContextError(FREED)
        return self._collectives

    @property
    def communicator(self) -> MPI.Intracomm:
        """The strategy's private communicator.

        It is freed with the strategy (``experimental_finalize()``, or when the strategy is
        garbage-collected): ``Dup()`` it to keep using it after that.
        """
        return self.collectives.comm

    @property
    def communication_options(self) -> CommunicationOptions:
        return self._options

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The device of this rank's replica (``.../device:GPU:i`` when it was placed on a GPU)."""
        return (self.placement.device(self.rank),)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Where variables live: on every replica's device; this rank holds its own copy."""
        return self.worker_devices

    @property
    def experimental_require_static_shapes(self) -> bool:
        """False: all_gather and distributed datasets handle varying shapes."""
        return False

    # -- synced objects (variables) and the writes a merge_fn makes to them -----------

    def register_synced(self, obj: Any) -> int:
        """Give ``obj`` a key that is the same on every rank (objects are created in the same order)."""
        key = next(self._synced_keys)
        self._synced[key] = obj
        return key

    def synced(self, key: int) -> Any:
        """The object registered under ``key`` (None if it was freed)."""
        return self._synced.get(key)

    def apply_merge_writes(self, writes: list[tuple[int, Any]]) -> None:
        """Replay on this rank the writes rank 0's merge_fn made to synced objects."""
        for key, payload in writes:
            obj = self._synced.get(key)
            if obj is not None:
                obj.apply_merge_write(payload)

    def stragglers(self) -> Stragglers:
        """Who arrived last at this strategy's collectives so far, and how long the others waited.

        Every rank keeps the same tally, learned in the handshakes at no extra message (each
        collective's result arrives with the next one); it is empty with the check off.
        ``print()`` it for a table; ``.flagged`` lists the ranks late markedly more often than
        chance, by ``MPISTRAT_STRAGGLER_MS`` (default 5 ms) or more on average.

        >>> import mpistrat
        >>> mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF).extended.stragglers().flagged
        []
        """
        return self.collectives.stragglers.table()

    def rebind(self, comm: MPI.Intracomm, hosts: tuple[str, ...]) -> None:
        """Go on over ``comm``, the survivors of the strategy's communicator after a rank died (collective
        over it; ``hosts``: theirs, in its rank order). The old communicator is released (unwatched,
        its transports and requests closed, freed); the collectives, the same object, start afresh on
        ``comm`` (see ``Collectives.rebind``); rank, size and the reductions follow."""
        c = self._collectives
        old, closer = self._comm, c.closer()
        detached = self._release.detach() if self._release is not None else None
        if old is not None and detached is not None:
            watchdog.release(c.monitor, old, closer, wait=True)
        c.rebind(comm)
        self._comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        release = weakref.finalize(c, watchdog.release, c.monitor, comm, c.closer())
        release.atexit = False
        self._release = release
        self.placement = dataclasses.replace(self.placement, hosts=hosts, processes=())
        c.locate(hosts)
        self._spmd = SpmdReducer(self)
        self._local = LocalReducer(self.size, self._options, reductions.mirrored(self.size))

    def finalize(self) -> None:
        self._collectives.finish_pending()  # a background checkpoint save, while MPI still can
        step = self._collectives.step_check
        if (
            step is not None and not step.learning
        ):  # MPISTRAT_CHECK=step: what went unchecked since the last step
            self._collectives.agree("experimental_finalize")
        detached = self._release.detach() if self._release is not None else None
        if self._comm is not None and detached is not None:
            _, release, args, _ = detached
            release(*args, wait=True)  # unwatches first: the watchdog must not touch a freed communicator
        self._comm = None
        self._collectives.free()

    # -- context rules ------------------------------------------------------------------

    def _require_cross_replica(self, method: str) -> modes.Mode:
        """Cross-replica context of this strategy, or the default context; else raise as tf does."""
        mode = modes.current_mode()
        if mode.kind is not modes.DEFAULT:
            self._require_cross_replica_of_mine(method, mode)
        return mode

    def _require_cross_replica_of_mine(self, method: str, mode: modes.Mode) -> None:
        """Outside the default context: this strategy's, and cross-replica."""
        if mode.strategy is not self._container_strategy:
            self._require_scope(method, mode)  # raises
        if mode.replica_context is not None:
            raise ContextError(
                f"{method}: Method requires being in cross-replica context, {modes.CROSS_REPLICA_HINT}"
            )

    def _require_scope(self, method: str, mode: modes.Mode | None = None) -> None:
        mode = mode or modes.current_mode()
        if mode.strategy is self._container_strategy:
            return
        if mode.kind is modes.DEFAULT:
            raise ContextError(
                f'{method}: Need to be inside "with strategy.scope()" for {self._container_strategy}'
            )
        raise ContextError(
            f"{method}: Mixing different tf.distribute.Strategy objects: {mode.strategy} is not "
            f"{self._container_strategy}"
        )

    def _enter(self, mode: modes.Mode) -> contextlib.AbstractContextManager[Any]:
        """Enter this strategy's scope when called from the default context (as tf does)."""
        if mode.kind is modes.DEFAULT:
            return self._container_strategy.scope()
        return _NOTHING

    def _reductions(self, method: str) -> SpmdReducer | LocalReducer:
        """The reducer of the current cross-replica context (else raise), for ``reduce_to``,
        ``batch_reduce_to`` and ``broadcast_to``, which check their arguments, then hand them to it."""
        mode = modes.current_mode()
        if mode.kind is not modes.DEFAULT:
            self._require_cross_replica_of_mine(method, mode)
        return self.reducer(mode)

    def reducer(self, mode: modes.Mode) -> SpmdReducer | LocalReducer:
        """The one place that tells a merge_fn, where every replica's value is at hand (array
        arithmetic), from the SPMD context, where each rank holds its own (one collective)."""
        return self._local if mode.kind is modes.MERGE else self._spmd

    # -- reductions ---------------------------------------------------------------------

    def reduce_to(
        self, reduce_op: Any, value: Any, destinations: Any, options: CommunicationOptions | None = None
    ) -> Any:
        """Combine (sum or mean) a per-replica ``value`` across replicas, copied to ``destinations``.

        In the SPMD cross-replica context this is one all-reduce of every rank's
        local value and returns this rank's copy of the result; inside a
        ``merge_fn`` ``value`` is a ``PerReplica`` holding every replica's value,
        it is reduced locally and a ``Mirrored`` is returned.

        Args:
            reduce_op: ``ReduceOp`` or its name; ``VariableAggregation.SUM``/``MEAN``/
                ``ONLY_FIRST_REPLICA`` are accepted too.
            value: a per-replica value (a nest of arrays and numbers).
            destinations: a variable, a distributed value or a device string:
                where the result is wanted (every replica here).
            options: a :class:`~mpistrat.CommunicationOptions` overriding the strategy's
                for this reduction (as for ``all_reduce``); checked but unused inside a
                root-mode ``merge_fn``, where nothing is communicated.
        """
        reducer = self._reductions("reduce_to")
        op = reductions.reduce_op(reduce_op, "reduce_to")
        reductions.check_destinations(destinations, "reduce_to")
        return reducer.reduce_to(op, value, options)

    def batch_reduce_to(
        self, reduce_op: Any, value_destination_pairs: Any, options: CommunicationOptions | None = None
    ) -> list[Any]:
        """Several ``reduce_to`` calls in one: a single fused all-reduce for the whole batch.

        Returns one result per ``(value, destinations)`` pair, in order. ``options`` as for
        :meth:`reduce_to` (``bytes_per_pack`` splits the fused buffer into packs).
        """
        reducer = self._reductions("batch_reduce_to")
        op = reductions.reduce_op(reduce_op, "batch_reduce_to")
        pairs = reductions.pairs(value_destination_pairs)
        return list(reducer.batch_reduce_to(op, [v for v, _ in pairs], options))

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copy rank 0's ``tensor`` to every replica (``destinations``: a variable or device string).

        In the SPMD context every rank gets rank 0's value (a collective); inside a
        ``merge_fn`` the value is wrapped as ``Mirrored``.
        """
        reducer = self._reductions("broadcast_to")
        reductions.check_destinations(destinations, "broadcast_to")
        return reducer.broadcast_to(tensor)

    # -- updates ------------------------------------------------------------------------

    def update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Run ``fn(v, *args, **kwargs)`` on this rank's copy ``v`` of ``var``.

        As tf, each argument is what this replica holds: a ``PerReplica``'s own component
        (values that differ between replicas written to a mirrored variable are an error
        on every rank while the check is on), a ``Mirrored``'s value, a variable's copy.
        Inside a ``merge_fn`` the writes reach every rank with the merge_call broadcast. In
        replica context (inside ``strategy.run``, as Keras optimizers call it without
        merge_call) ``fn`` runs on this replica's copy there. With ``group=False`` each leaf
        of the result becomes a tuple of the values held here (one per local replica).
        """
        mode = modes.current_mode()
        if mode.kind is modes.REPLICA and mode.strategy is self._container_strategy:
            return self._update_copy(var, fn, args, kwargs, group, mode)
        mode = self._require_cross_replica("update")
        if mode.kind is modes.DEFAULT:  # as tf: from the default context, in this strategy's scope
            with self._container_strategy.scope():
                return self.update(var, fn, args, kwargs, group)
        return self._update_copy(var, fn, args, kwargs, group, mode)

    def _update_copy(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        group: bool,
        mode: modes.Mode,
    ) -> Any:
        """``update``'s work in a replica or cross-replica context of this strategy."""
        from mpistrat.distribute import updates  # a job that updates no variable never loads it

        merging = mode.kind is modes.MERGE
        (a, kw), taken = updates.select_replica(
            (tuple(args), dict(kwargs or {})), self.rank, self.size, "update", one_process=merging
        )
        if (
            not isinstance(var, HasLocalCopy)
            or getattr(var, "distribute_strategy", None) is not self._container_strategy
        ):
            raise InvalidArgumentError(
                f"update: var must be a variable created in this strategy's scope(); got {var!r}. "
                "Create it inside `with strategy.scope():`"
            )
        if taken and not merging:
            updates.check_per_replica_writes(self.collectives, var, taken, "update")
        component = local_variable(var)
        writes = self.writes
        writes.in_sync += 1  # as writes_in_sync(), without a generator: this is per step and variable
        try:
            result = fn(component, *a, **kw)
        finally:
            writes.in_sync -= 1
        return result if group else updates.ungroup(result)

    @contextlib.contextmanager
    def writes_in_sync(self) -> Iterator[None]:
        """Cross-replica writes inside are the same on every rank by construction (computed from
        reduced or broadcast values), so they are not compared across ranks."""
        writes = self.writes
        writes.in_sync += 1
        try:
            yield
        finally:
            writes.in_sync -= 1

    def update_non_slot(
        self,
        colocate_with: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` once on every rank, where the non-slot variables live.

        ``colocate_with`` is normally what :meth:`non_slot_devices` returned; any value is
        accepted, as tf's default strategy accepts one (every rank holds one replica, so there
        is no device to choose). Writes ``fn`` makes to mirrored variables reach every rank, as
        with :meth:`update`.
        """
        from mpistrat.distribute import updates

        mode = self._require_cross_replica("update_non_slot")
        with self._enter(mode), self.writes_in_sync():
            (a, kw), _ = updates.select_replica(
                (tuple(args), dict(kwargs or {})), self.rank, self.size, "update_non_slot",
                one_process=mode.kind is modes.MERGE,
            )  # fmt: skip
            result = fn(*a, **kw)
        return result if group else updates.ungroup(result)

    def non_slot_devices(self, var_list: Any) -> tuple[str, ...]:
        """Devices for non-slot variables (an optimizer's step counter): every parameter device.

        Pass the result to :meth:`colocate_vars_with` when creating them and to
        :meth:`update_non_slot` when updating them.
        """
        return self.parameter_devices

    def colocate_vars_with(self, colocate_with_variable: Any) -> contextlib.AbstractContextManager[None]:
        """Scope in which variables are created on the same devices as ``colocate_with_variable``.

        Only inside ``self.scope()``. The target is a variable created in this
        strategy's scope, or the value of :meth:`non_slot_devices`. On MPI every
        variable lives on every replica, so this records the relation only.

        >>> import mpistrat
        >>> strategy = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
        >>> with strategy.scope():
        ...     var1 = mpistrat.Variable(1.0)
        ...     with strategy.extended.colocate_vars_with(var1):
        ...         var2 = mpistrat.Variable(0.0)
        >>> var2.colocated_with is var1
        True
        """
        self._require_scope("colocate_vars_with")
        target = colocate_with_variable
        owned = getattr(target, "distribute_strategy", None) is self._container_strategy
        devices = isinstance(target, tuple) and target == self.parameter_devices  # never an array's ==
        if not owned and not devices:
            raise InvalidArgumentError(
                "`colocate_vars_with` must only be passed a variable created in this "
                f"tf.distribute.Strategy.scope(), not: {colocate_with_variable!r} (a variable created in "
                "this strategy's scope(), or the value of non_slot_devices())"
            )
        return modes.colocation(self._container_strategy, colocate_with_variable)

    def value_container(self, value: Any) -> Any:
        """The distributed variable ``value`` (a per-rank copy) belongs to, else ``value`` itself."""
        owner = getattr(value, "owner", None) if isinstance(value, HasLocalCopy) else None
        return value if owner is None else owner

    def variable_created_in_scope(self, v: Any) -> bool:
        """True if ``v`` was created while this strategy's ``scope()`` was active.

        For the default strategy: True for variables created outside any scope.
        """
        if not isinstance(v, HasLocalCopy):
            raise InvalidArgumentError(
                f"variable_created_in_scope: expected a Variable; got {type(v).__name__}"
            )
        return getattr(v, "distribute_strategy", None) is self._scope_owner

    def read_var(self, v: Any) -> Any:
        """The cross-replica value of the variable ``v`` (as tf): a mirrored variable's value, a
        sync-on-read variable's copies aggregated over the replicas; call it in cross-replica context."""
        self._require_cross_replica("read_var")
        if not isinstance(v, HasLocalCopy) or not hasattr(v, "read_value"):
            raise InvalidArgumentError(f"read_var: expected a Variable; got {type(v).__name__}")
        return v.read_value()

    def call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Run ``fn`` once per replica, in replica context (as ``Strategy.run``)."""
        self._require_cross_replica("call_for_each_replica")
        return self._container_strategy.run(fn, args=args, kwargs=kwargs)

    def call_merge_fn(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run ``merge_fn(strategy, *args, **kwargs)`` as ``ReplicaContext.merge_call`` does, once it
        checked the replica context: where ``merge_call`` says (see :mod:`mpistrat.distribute.merge`)."""
        from mpistrat.distribute import merge  # a job that never calls merge_call never loads it

        strategy = self._container_strategy
        if self.merge_call_mode == "every_rank":
            return merge.merge_on_every_rank(strategy, merge_fn, args, kwargs)
        return merge.merge_on_root(strategy, merge_fn, args, kwargs)


_NOTHING = contextlib.nullcontext()
