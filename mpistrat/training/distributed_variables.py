"""Distributed variables: mirrored and sync-on-read, as ``tf.distribute``'s.

Inside ``strategy.scope()`` (or ``strategy.run``) ``Variable(...)`` makes a
:class:`MirroredVariable` (synchronization AUTO/ON_WRITE), whose initial value is rank 0's,
broadcast at creation, or a :class:`SyncOnReadVariable` (ON_READ). Either holds one copy per
rank (a plain :class:`~mpistrat.training.variables.Variable`). Writes in replica context are
aggregated across replicas as ``aggregation`` says; writes in cross-replica context apply on
every rank. What a write does inside a merge_fn or ``update()`` the strategy says through the
:class:`~mpistrat.interface.protocols.SyncedWrites` each variable is handed at creation.

>>> import mpistrat, numpy as np
>>> strategy = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
>>> with strategy.scope():
...     v = mpistrat.Variable(np.zeros(2))
>>> type(v).__name__, v.assign_add([1.0, 2.0]).numpy()
('MirroredVariable', array([1., 2.]))
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

from mpistrat.collectives import check_enabled
from mpistrat.collectives.fingerprint import checksum
from mpistrat.comm import packing
from mpistrat.errors import ContextError, InvalidArgumentError, MpistratError, enum_member
from mpistrat.interface import modes
from mpistrat.interface.protocols import SyncedWrites
from mpistrat.reduce_op import ReduceOp
from mpistrat.training.recovery import broadcast_in_place
from mpistrat.training.variables import (
    Variable,
    VariableAggregation,
    VariableSynchronization,
    combine,
    plain_variable,
    read_only,
    set_class_chooser,
)
from mpistrat.values import DistributedValues

__all__ = ["DistributedVariable", "MirroredVariable", "SyncOnReadVariable"]

_AGGREGATION_HELP = (
    "The replicas wrote different values to {name!r} (aggregation NONE) in replica context, which would "
    "leave its copies different. You must specify an aggregation method to update a MirroredVariable in "
    "Replica Context when the replicas' values differ: pass e.g. "
    "`mpistrat.Variable(..., aggregation=mpistrat.VariableAggregation.SUM)` (SUM, MEAN or "
    "ONLY_FIRST_REPLICA), or update it in cross-replica context: call "
    "`mpistrat.get_replica_context().merge_call(merge_fn)` and, in merge_fn, "
    "`strategy.extended.update(var, fn)`."
)
_PYTHON_NUMBERS = (bool, int, float, complex)


def canonical_name(name: str) -> str:
    """``name`` without the numbers that tell replicas' names apart (``_<digits>`` before a ``/`` or at
    the end), as tf's mirrored variable creator compares names; tf strips one digit, this any number,
    so that names made from a rank's number match at any number of ranks.

    >>> canonical_name("dense_12/kernel_3"), canonical_name("step")
    ('dense/kernel', 'step')
    """
    return _REPLICA_NUMBER.sub("", name)


_REPLICA_NUMBER = re.compile(r"_\d+(?=/|$)")


class DistributedVariable(Variable, DistributedValues):
    """A variable with one copy per replica; this rank holds its own copy (``values[0]``)."""

    mirrored = False

    def __init__(self, initial_value: Any, **kwargs: Any):
        super().__init__(initial_value, **kwargs)
        if self._synchronization is VariableSynchronization.NONE:
            raise InvalidArgumentError(
                "`NONE` variable synchronization mode is not supported with tf.distribute strategy. Please "
                f"change the `synchronization` for variable: {self._name} (AUTO, ON_WRITE or ON_READ; a "
                "variable created in a strategy's scope has a copy on every rank)"
            )
        mode = modes.current_mode()
        strategy = mode.strategy
        extended = strategy.extended
        # rank 0's initial value everywhere; a rank with another shape, dtype or kind fails them all
        sync, agg = self._synchronization.name, self._aggregation.name
        kind = f"variable_creation({canonical_name(self._name)}, {sync}, {agg})"
        error = None
        if self._aggregation is VariableAggregation.MEAN and self._value.dtype.kind not in "fc":
            # as tf: a mean of integer copies would truncate (0.5 becomes 0)
            error = InvalidArgumentError(
                f"Variable {self._name!r}: creating distributed tf.Variable with aggregation=MEAN and a "
                "non-floating dtype is not supported, please use a different aggregation or dtype (a mean "
                f"of {self._value.dtype} copies would truncate)"
            )
        collectives = extended.collectives
        value = collectives.broadcast(self._value, kind=kind, error=error)
        if collectives.size > 1:  # names may differ in a replica's number: rank 0's wins, as tf's replica 0's
            self._name = collectives.broadcast_from_root(self._name, kind="variable_creation (name)")
        del self._value
        self._component = plain_variable(value, self._name, self._trainable)
        self._component.owner = self
        DistributedValues.__init__(self, (self._component,))
        self._distribute_strategy = strategy
        self._extended = extended
        self.synced_key = extended.register_synced(self)
        self._writes: SyncedWrites = extended.writes  # what its writes do now (see there)
        if self.mirrored:
            collectives.recoverables.add(self)  # its copy taken from a survivor after a rank's death

    def recovery_facts(self) -> None:
        return None

    def recover(self, recovery: Any, facts: list[Any]) -> None:
        """After a rank's death: this copy takes ``recovery.source``'s value (collective over the
        survivors), unless an optimizer's flat storage holds it (the optimizer repairs that)."""
        if self._component.storage is not None:
            return
        value = self._component.local_array
        array = value.copy() if recovery.collectives.rank != recovery.source else value
        broadcast_in_place(recovery.collectives.comm, array, recovery.source)
        if array is not value:
            self._component.local_array = array

    def _local(self) -> Any:
        return self._component.local_array

    @property
    def local_array(self) -> Any:
        """This rank's copy's array (see :attr:`Variable.local_array`)."""
        return self._component.local_array

    @local_array.setter
    def local_array(self, array: Any) -> None:
        self._component.local_array = array

    def _local_variable(self) -> Variable:
        return self._component

    @property
    def device(self) -> str:
        return self._extended.parameter_devices[0]

    def note_write(self, new: Any) -> None:
        """A write to this rank's copy; inside rank 0's merge_fn it must reach the other ranks."""
        merged = self._writes.merged
        if merged is not None:
            merged.append((self.synced_key, new))

    def apply_merge_write(self, payload: Any) -> None:
        xp = packing.array_module(self._local())
        self._component.local_array = xp.asarray(payload)

    def _mode(self, method: str) -> modes.Mode:
        """The current mode; a different strategy's scope is an error."""
        mode = modes.current_mode()
        if mode.kind is not modes.DEFAULT and mode.strategy is not self._distribute_strategy:
            raise ContextError(
                f"{self._name}.{method}: this variable belongs to {self._distribute_strategy}, but the "
                f"current strategy is {mode.strategy}; use it inside its own strategy's scope()"
            )
        if (
            mode.kind is modes.MERGE
            and mode.replica_context is not None
            and (method != "value" or not self.mirrored)
        ):
            raise ContextError(
                f"{self._name}.{method}: strategy.run inside a merge_fn runs every replica in turn on rank 0 "
                "alone, which holds only its own copy of the variable and cannot communicate; only reading "
                "a mirrored variable works there. Use MPIStrategy(merge_call='every_rank')"
            )
        return mode

    def _aggregate(
        self, op: VariableAggregation, local: Any, kind: str, error: MpistratError | None = None
    ) -> Any:
        """One collective combining every rank's ``local`` as ``op`` says."""
        collectives, kind = self._extended.collectives, f"{kind}({self._name})"
        if op is VariableAggregation.ONLY_FIRST_REPLICA:
            out = collectives.broadcast(local, kind=kind, error=error)
        else:
            out = collectives.all_reduce(ReduceOp[op.name], local, kind=kind, error=error)
        return out.astype(self.dtype, copy=False)

    def _agreed(self, how: str, value: Any, mode: modes.Mode, advice: str = "") -> Any:
        """A cross-replica write's value, after checking every rank writes the same bytes.

        Every rank executes a cross-replica write, each with its own ``value``: one that
        differs between ranks would leave the copies silently different, so while the
        check is on the ranks compare checksums in the handshake and all raise instead.
        Writes inside ``update`` (computed from reduced values) and inside a merge_fn on rank 0
        (replayed everywhere) are not compared.
        """
        extended = self._extended
        if mode.kind is modes.MERGE or self._writes.in_sync or not check_enabled(extended.collectives):
            return self._coerce(value, how)
        new: Any = None  # stays None only on a rank that raises ``error`` (then ``describe`` is not called)
        error: MpistratError | None = None
        code = 0
        try:
            new = self._coerce(value, how)
            code = checksum(new)
        except MpistratError as exc:
            error = exc
        extended.collectives.agree(
            f"{how}({self._name})",
            fingerprint=code,
            describe=lambda: {
                "leaves": [(repr(self._name), f"value with checksum {code:016x}", tuple(new.shape))],
                "advice": (advice or _DIFFERENT_WRITES).format(name=self._name, how=how),
            },
            error=error,
        )
        return new

    def __repr__(self) -> str:
        return f"{type(self).__name__}:{{\n  {self._extended.rank}: {self._component!r}\n}}"

    def __reduce__(self) -> Any:
        raise TypeError(
            f"a distributed variable ({self._name!r}) cannot be pickled: it is one copy of a variable that "
            "lives on every rank; pass its value (var.numpy()) instead"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Variable:
        """A new distributed variable of the same strategy holding a copy of each rank's copy, as tf's.

        Creating it is collective, as creating any distributed variable is: deep-copy on every rank.
        """
        strategy = self._distribute_strategy
        mode = modes.current_mode()
        scope = strategy.scope() if mode.kind is modes.DEFAULT else contextlib.nullcontext()
        local = self._local().copy()
        with scope:
            copy = type(self)(
                local,
                trainable=self._trainable,
                name=self._name,
                synchronization=self._synchronization,
                aggregation=self._aggregation,
                constraint=self._constraint,
            )
        if not self.mirrored:  # a sync-on-read variable's copies differ: each rank keeps its own
            copy._component.local_array = local
        memo[id(self)] = copy
        return copy


_DIFFERENT_WRITES = (
    "The ranks wrote different values to {name!r} in cross-replica context, which would leave its copies "
    "different. Write a value that is the same on every rank (e.g. one reduced with strategy.reduce, or "
    "broadcast with strategy.extended.broadcast_to), or write in replica context with an aggregation "
    "(inside strategy.run)."
)


class MirroredVariable(DistributedVariable):
    """Kept identical on every rank: created from rank 0's value, written only through aggregation."""

    mirrored = True  # its copies must stay bitwise equal (MPISTRAT_CHECK=strict compares them)

    def value(self) -> Any:
        self._mode("value")
        return read_only(self._component.local_array)

    def _write(self, how: str, value: Any) -> None:
        mode = self._mode(how)
        if mode.kind is modes.REPLICA:
            self._write_in_replica(how, value, mode)
            return
        if self._writes.in_sync:  # inside update()/update_non_slot(): this rank's copy, as it is
            self._component._write(how, value)
            return
        value = self._agreed(how, value, mode)
        self._extended.update(self, lambda v, x: v._write(how, x), args=(value,))

    def _write_in_replica(self, how: str, value: Any, mode: modes.Mode) -> None:
        agg = self._aggregation
        if agg is VariableAggregation.NONE:  # as tf: each replica writes its copy; they must write alike
            self._component._write(how, self._agreed(how, value, mode, _AGGREGATION_HELP))
            return
        error, local = None, None
        try:
            local = self._coerce(value, how)
            if agg is VariableAggregation.SUM and type(value) in _PYTHON_NUMBERS and self._extended.size > 1:
                raise InvalidArgumentError(  # as tf, which sums only values computed in each replica
                    f"{self._name}.{how}: A non-DistributedValues value {value!r} cannot be reduced with "
                    "the given reduce op ReduceOp.SUM: a Python number is the same on every replica, as in "
                    f"tf, and its sum over {self._extended.size} replicas is rarely what was meant. Write an "
                    "array computed in the replica (np.asarray(x)) to sum the replicas' values, or use "
                    "aggregation MEAN or ONLY_FIRST_REPLICA for a value that is the same on every replica"
                )
        except MpistratError as exc:
            error = exc
        if local is None:
            local = packing.array_module(self._local()).zeros_like(self._local())
        combined = self._aggregate(agg, local, "variable_aggregation", error)
        self._component.local_array = combine(how, self._component.local_array, combined)


class SyncOnReadVariable(DistributedVariable):
    """Each replica updates its own copy; reading in cross-replica context aggregates the copies."""

    def value(self) -> Any:
        mode = self._mode("value")
        local = self._component.local_array
        if mode.kind is modes.REPLICA:
            return read_only(local)
        agg = self._aggregation
        if agg is VariableAggregation.NONE:
            raise InvalidArgumentError(
                f"{self._name}: Could not convert from `tf.VariableAggregation` NONE to "
                "`tf.distribute.ReduceOp`: a sync-on-read variable with aggregation NONE cannot be read in "
                "cross-replica context (there is no way to combine the replicas' copies); create it with "
                "aggregation SUM, MEAN or ONLY_FIRST_REPLICA, or read it in replica context"
            )
        if mode.kind is modes.MERGE:
            if agg is VariableAggregation.ONLY_FIRST_REPLICA:
                return read_only(local)  # merge_fn runs on rank 0, which holds replica 0's copy
            raise ContextError(
                f"{self._name}: a {agg.name} sync-on-read variable cannot be read inside merge_fn, which "
                "runs on rank 0 alone; read it in strategy.scope() on every rank, or pass its local value "
                "to merge_call"
            )
        return read_only(self._aggregate(agg, local, "sync_on_read"))

    def _write(self, how: str, value: Any) -> None:
        mode = self._mode(how)
        if mode.kind is modes.REPLICA:
            self._component._write(how, value)
            return
        sums = self._aggregation is VariableAggregation.SUM
        if how != "assign" and sums:
            raise InvalidArgumentError(  # as tf: each copy would add the delta, the sum n times it
                f"{self._name}.{how}: SyncOnReadVariable does not support `{how}` in cross-replica context "
                "when aggregation is set to `tf.VariableAggregation.SUM`. Update each replica's copy inside "
                "strategy.run, or set the summed value with assign"
            )
        new = self._agreed(how, value, mode)
        if sums:  # the copies must sum to the value
            new = self._share(new, mode)
        if how != "assign" and mode.kind is modes.MERGE:  # rank 0 alone: every rank updates its own copy
            writes = self._writes.merged
            if writes is None:  # merge_call starts the record before it runs merge_fn
                raise MpistratError(f"{self._name}.{how}: a merge write outside merge_call")
            self._component.local_array = combine(how, self._component.local_array, new)
            writes.append((self.synced_key, (how, new)))
            return
        self._component._write(how, new)

    def _share(self, total: Any, mode: modes.Mode) -> Any:
        """This rank's copy of a SUM variable whose copies sum to ``total``.

        Integers are split exactly: the first ``total % size`` ranks hold one more, so that
        ``10`` over 3 ranks is 4, 3, 3 (a floor division alone would read back 9). Inside a
        merge_fn, rank 0's share is every rank's (it alone runs there).
        """
        size, xp = self._extended.size, packing.array_module(total)
        if self.dtype.kind not in "iu" or mode.kind is modes.MERGE:
            return (total / size).astype(self.dtype, copy=False)
        quotient, remainder = xp.divmod(total, size)
        return (quotient + (self._extended.rank < remainder)).astype(self.dtype, copy=False)

    def apply_merge_write(self, payload: Any) -> None:
        if isinstance(payload, tuple):  # (how, delta): applied to this rank's own copy
            how, delta = payload
            local = self._local()
            self._component.local_array = combine(how, local, packing.array_module(local).asarray(delta))
            return
        super().apply_merge_write(payload)


def _class_to_create(synchronization: Any) -> type[Variable]:
    """Which variable ``Variable(...)`` makes here: plain outside a scope, else mirrored or sync-on-read."""
    mode = modes.current_mode()
    colocation = modes.current_colocation()
    if colocation is not None and colocation[0] is not mode.strategy:
        raise ContextError(
            "creating a variable inside colocate_vars_with() of a strategy whose scope is not active; "
            f'need to be inside "with strategy.scope()" for {colocation[0]}'
        )
    if not modes.has_strategy():
        return Variable
    if mode.inside_default:
        raise ContextError(  # a RuntimeError, as tf's
            "Mixing different tf.distribute.Strategy objects: creating a variable in "
            f"{mode.strategy}'s scope, which is inside the default strategy's scope(); leave the default "
            "strategy's scope first"
        )
    if mode.kind is modes.MERGE:
        raise ContextError(
            "cannot create a distributed variable inside merge_fn: it runs on rank 0 alone and creation is "
            "collective; create variables in strategy.scope() or in replica context before merge_call"
        )
    try:
        sync = enum_member(VariableSynchronization, synchronization, "synchronization")
    except InvalidArgumentError:
        return MirroredVariable  # whose __init__ names the variable and its bad synchronization
    return SyncOnReadVariable if sync is VariableSynchronization.ON_READ else MirroredVariable


set_class_chooser(_class_to_create)
