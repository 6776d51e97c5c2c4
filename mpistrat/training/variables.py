"""Variables: plain, mirrored and sync-on-read, as ``tf.Variable`` under ``tf.distribute``.

``Variable(...)`` outside any strategy scope is a plain variable. Inside
``strategy.scope()`` (or ``strategy.run``) it is a :class:`MirroredVariable`
(synchronization AUTO/ON_WRITE), whose initial value is rank 0's, broadcast at
creation, or a :class:`SyncOnReadVariable` (ON_READ). Either holds one copy per
rank. Writes in replica context are aggregated across replicas as ``aggregation``
says; writes in cross-replica context apply on every rank.

>>> import mpistrat, numpy as np
>>> v = mpistrat.Variable(np.zeros(2))
>>> v.assign_add([1.0, 2.0]).numpy()
array([1., 2.])
>>> (v * 2).tolist()
[2.0, 4.0]
"""

from __future__ import annotations

import contextlib
import enum
import operator
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat import context
from mpistrat.collectives import check_enabled, mismatch
from mpistrat.comm import packing
from mpistrat.errors import ContextError, InvalidArgumentError, MpistratError, enum_member
from mpistrat.reduce_op import ReduceOp
from mpistrat.values import DistributedValues, HasLocalCopy, Mirrored, PerReplica

if TYPE_CHECKING:
    from mpistrat.training.flat_storage import FlatBuffer

__all__ = [
    "Variable",
    "MirroredVariable",
    "SyncOnReadVariable",
    "VariableSynchronization",
    "VariableAggregation",
]


class VariableSynchronization(enum.Enum):
    """When a distributed variable is synchronized, as ``tf.VariableSynchronization``."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.Enum):
    """How replica-context updates (or sync-on-read reads) combine, as ``tf.VariableAggregation``."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


_AGGREGATION_HELP = (
    "You must specify an aggregation method to update a {kind} in replica context: pass e.g. "
    "`mpistrat.Variable(..., aggregation=mpistrat.VariableAggregation.SUM)` (SUM, MEAN or "
    "ONLY_FIRST_REPLICA). Mirrored variables are kept in sync, so a replica-context write must say how "
    "the replicas' values combine. Alternatively update it in cross-replica context: call "
    "`mpistrat.get_replica_context().merge_call(merge_fn)` and, in merge_fn, "
    "`strategy.extended.update(var, fn)`."
)


class Variable(HasLocalCopy):
    """A mutable array: NumPy or CuPy, with ``assign``/``assign_add``/``assign_sub``.

    Args:
        initial_value: an array, a number, or a callable returning one.
        trainable: whether optimizers should update it (default: True unless ON_READ).
        name: a name for messages and ``repr``.
        dtype: convert the initial value to this dtype.
        synchronization: ``VariableSynchronization`` (distributed variables only).
        aggregation: ``VariableAggregation`` (distributed variables only); None is NONE, as tf.
        constraint: a callable an optimizer may apply to the value after an update, kept as
            :attr:`constraint` (as tf, writes do not apply it; mpistrat's optimizers do not).
    """

    _owner: DistributedVariable | None = None  # the distributed variable this copy belongs to
    _distribute_strategy: Any = None
    _storage: FlatBuffer | None = None  # the optimizer's flat array this copy is a slice of, if any
    _constraint: Callable[[Any], Any] | None = None
    colocated_with: Any = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Variable:
        if cls is Variable:
            cls = _class_to_create(kwargs.get("synchronization", VariableSynchronization.AUTO))
        return object.__new__(cls)

    def __init__(
        self,
        initial_value: Any,
        *,
        trainable: bool | None = None,
        name: str | None = None,
        dtype: Any = None,
        synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
        aggregation: VariableAggregation | str | None = VariableAggregation.NONE,
        constraint: Callable[[Any], Any] | None = None,
    ):
        if constraint is not None and not callable(constraint):
            raise InvalidArgumentError(
                f"The `constraint` argument must be a callable; got {type(constraint).__name__}"
            )
        self._constraint = constraint
        self._synchronization = enum_member(VariableSynchronization, synchronization, "synchronization")
        none_means_none = VariableAggregation.NONE if aggregation is None else aggregation  # as tf
        self._aggregation = enum_member(VariableAggregation, none_means_none, "aggregation")
        on_read = self._synchronization is VariableSynchronization.ON_READ
        if on_read and trainable:
            raise InvalidArgumentError(
                "synchronization=ON_READ is only for non-trainable variables; you passed trainable=True. "
                "Pass trainable=False (the default for ON_READ)"
            )
        self._trainable = (not on_read) if trainable is None else bool(trainable)
        self._name = "Variable" if name is None else str(name)
        self._value = _initial(initial_value, dtype, self._name)
        colocation = context.current_colocation()
        self.colocated_with = None if colocation is None else colocation[1]

    @classmethod
    def _plain(cls, value: Any, name: str, trainable: bool) -> Variable:
        var = object.__new__(Variable)
        var._synchronization, var._aggregation = VariableSynchronization.NONE, VariableAggregation.NONE
        var._trainable, var._name, var._value = trainable, name, value
        return var

    # -- properties -------------------------------------------------------------------

    name = property(lambda self: self._name, doc="The variable's name.")
    trainable = property(lambda self: self._trainable, doc="Whether optimizers update it.")
    synchronization = property(lambda self: self._synchronization)
    aggregation = property(lambda self: self._aggregation)
    distribute_strategy = property(lambda self: self._distribute_strategy, doc="Owning strategy, or None.")
    constraint = property(lambda self: self._constraint, doc="The constraint given at creation, or None.")

    @property
    def dtype(self) -> np.dtype:
        return self._local().dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._local().shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _local(self) -> Any:
        """This rank's copy, never communicating (for metadata and ``repr``)."""
        return self._value

    def _local_copy(self) -> Any:
        return self._local()

    # -- reads ------------------------------------------------------------------------

    def value(self) -> Any:
        """The current value as an array (a NumPy or CuPy array; do not modify it in place)."""
        return self._value

    def read_value(self) -> Any:
        """The current value (as :meth:`value`)."""
        return self.value()

    def numpy(self) -> np.ndarray:
        """A NumPy copy of the current value."""
        return _to_numpy(self.value()).copy()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = _to_numpy(self.value())
        return arr.astype(dtype) if dtype is not None else (arr.copy() if copy else arr)

    # -- writes -----------------------------------------------------------------------

    def assign(
        self, value: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True
    ) -> Variable | None:
        """Set the value (same shape; a same-kind dtype); returns the variable, or None with
        ``read_value=False`` (as tf). ``use_locking`` and ``name`` are accepted and unused."""
        self._write("assign", value)
        return self if read_value else None

    def assign_add(
        self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True
    ) -> Variable | None:
        """Add ``delta``; returns the variable (None with ``read_value=False``)."""
        self._write("assign_add", delta)
        return self if read_value else None

    def assign_sub(
        self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True
    ) -> Variable | None:
        """Subtract ``delta``; returns the variable (None with ``read_value=False``)."""
        self._write("assign_sub", delta)
        return self if read_value else None

    def _write(self, how: str, value: Any) -> None:
        if self._owner is None:  # a plain variable, not a distributed one's copy
            _refuse_replica_write(self, how)
        new = self._coerce(value, how)
        if not self._private():  # someone holds the current value: leave it as it is
            self._set(_combine(how, self._value, new.copy() if how == "assign" else new))
            return
        old = self._value
        # Nobody else holds it (not a value() read earlier, nor a view of it): write in place, as
        # tf does, instead of allocating (and page-faulting) a new array at every optimizer step.
        xp = packing.array_module(old)
        if how == "assign":
            xp.copyto(old, new)
        else:
            (xp.add if how == "assign_add" else xp.subtract)(old, new, out=old)
        self._set(old)

    def _private(self) -> bool:
        """Whether nothing outside holds this copy's array (a ``value()`` read, a view of it)."""
        if self._storage is not None:
            return self._storage.private(self)
        return sys.getrefcount(self._value) <= _PRIVATE

    def _writable(self) -> _Writable:
        """A context giving this variable's array to update in place (the optimizers' arithmetic).

        Its own storage when nothing else holds it; a private copy when something does (a
        ``value()`` read earlier keeps its value, as a write in tf leaves earlier reads alone).

        >>> v = Variable(np.zeros(2))
        >>> with v._writable() as w:
        ...     w += 1.0
        >>> v.numpy()
        array([1., 1.])
        """
        return _Writable(self)

    def _set(self, new: Any) -> None:
        self._value = new
        if self._owner is not None:
            self._owner._note_write(new)

    def _coerce(self, value: Any, how: str) -> Any:
        """``value`` as an array of this variable's dtype, shape and array module, or raise."""
        local = self._local()
        if isinstance(value, Variable):
            value = value.value()
        elif isinstance(value, Mirrored):
            value = value.values[0]
        elif isinstance(value, PerReplica):
            raise InvalidArgumentError(
                f"{self._name}.{how}: got a PerReplica value; reduce it first (strategy.reduce or "
                "strategy.extended.reduce_to), or write in replica context inside strategy.run"
            )
        xp = packing.array_module(local)
        if type(value) in (bool, int, float, complex):
            kind = {bool: "b", int: "i", float: "f", complex: "c"}[type(value)]
            ok = kind in "bi" or (kind == "f" and local.dtype.kind in "fc") or local.dtype.kind == "c"
            if kind == "i" and local.dtype.kind in "iu":  # NumPy would wrap it (300 in uint8 is 44)
                info = np.iinfo(local.dtype)
                if not info.min <= value <= info.max:
                    raise InvalidArgumentError(
                        f"{self._name}.{how}: {value} does not fit in the variable's {local.dtype} "
                        f"({info.min} to {info.max})"
                    )
            arr = np.asarray(value, dtype=local.dtype) if ok else np.asarray(value)
        else:
            if xp is np and packing.array_module(value) is not np:
                value = value.get()
            arr = xp.asarray(value)
            ok = np.can_cast(arr.dtype, local.dtype, casting="same_kind")
        if not ok:
            raise InvalidArgumentError(
                f"{self._name}.{how}: cannot write a {arr.dtype} value into a {local.dtype} variable "
                f"without losing information; cast it first (e.g. value.astype({local.dtype.name!r}))"
            )
        if arr.shape != local.shape:
            raise InvalidArgumentError(
                f"{self._name}.{how}: expected a value of shape {tuple(local.shape)}; "
                f"got shape {tuple(arr.shape)}"
            )
        return xp.asarray(arr, dtype=local.dtype)  # may be the caller's array: never keep it

    # -- Python and NumPy protocols -----------------------------------------------------

    def __repr__(self) -> str:
        local = _to_numpy(self._local())
        shown = local.item() if local.ndim == 0 else local
        return f"<mpistrat.Variable {self._name!r} shape={local.shape} dtype={local.dtype}, numpy={shown!r}>"

    def __reduce__(self) -> Any:
        return (_rebuild_plain, (_to_numpy(self._local()), self._name, self._trainable))

    def __deepcopy__(self, memo: dict[int, Any]) -> Variable:
        """A new plain variable with a copy of the value, name, trainability and constraint."""
        copy = Variable._plain(self._local().copy(), self._name, self._trainable)
        copy._constraint = self._constraint
        copy._synchronization, copy._aggregation = self._synchronization, self._aggregation
        memo[id(self)] = copy
        return copy

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"len() of a scalar variable {self._name!r}")
        return self.shape[0]

    def __getitem__(self, key: Any) -> Any:
        return self.value()[key]

    def __bool__(self) -> bool:
        return bool(self.value())

    def __float__(self) -> float:
        return float(self.value())

    def __int__(self) -> int:
        return int(self.value())

    __hash__ = object.__hash__  # identity, so variables can key dicts; == compares values


def _binary(op: Callable[[Any, Any], Any], reflected: bool = False) -> Callable[[Variable, Any], Any]:
    def method(self: Variable, other: Any) -> Any:
        other = other.value() if isinstance(other, Variable) else other
        return op(other, self.value()) if reflected else op(self.value(), other)

    return method


for _name, _op in {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "pow": operator.pow,
    "matmul": operator.matmul,
}.items():
    setattr(Variable, f"__{_name}__", _binary(_op))
    setattr(Variable, f"__r{_name}__", _binary(_op, reflected=True))
for _name, _op in {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
                   "eq": operator.eq, "ne": operator.ne}.items():  # fmt: skip
    setattr(Variable, f"__{_name}__", _binary(_op))
for _name, _unary in {"neg": operator.neg, "pos": operator.pos, "abs": operator.abs}.items():
    setattr(Variable, f"__{_name}__", lambda self, _op=_unary: _op(self.value()))
del _name, _op, _unary


class DistributedVariable(Variable, DistributedValues):
    """A variable with one copy per replica; this rank holds its own copy (``values[0]``)."""

    mirrored = False

    def __init__(self, initial_value: Any, **kwargs: Any):
        super().__init__(initial_value, **kwargs)
        if self._synchronization is VariableSynchronization.NONE:
            raise InvalidArgumentError(
                f"synchronization=NONE is not supported for a variable created in a strategy's scope "
                f"(variable {self._name!r}); use AUTO, ON_WRITE or ON_READ"
            )
        mode = context.current_mode()
        strategy = mode.strategy
        extended = strategy.extended
        # rank 0's initial value everywhere; a rank with another shape, dtype or kind fails them all
        kind = f"variable_creation({self._name}, {self._synchronization.name}, {self._aggregation.name})"
        error = None
        if self._aggregation is VariableAggregation.MEAN and self._value.dtype.kind not in "fc":
            # as tf: a mean of integer copies would truncate (0.5 becomes 0)
            error = InvalidArgumentError(
                f"Variable {self._name!r}: creating a distributed variable with aggregation=MEAN and a "
                f"non-floating dtype ({self._value.dtype}) is not supported; use a float dtype or another "
                "aggregation"
            )
        value = extended.collectives.broadcast(self._value, kind=kind, error=error)
        del self._value
        self._component = Variable._plain(value, self._name, self._trainable)
        self._component._owner = self
        DistributedValues.__init__(self, (self._component,))
        self._distribute_strategy = strategy
        self._extended = extended
        self._synced_key = extended.register_synced(self)

    def _local(self) -> Any:
        return self._component._value

    def _local_variable(self) -> Variable:
        return self._component

    @property
    def device(self) -> str:
        return self._extended.parameter_devices[0]

    def _note_write(self, new: Any) -> None:
        """A write to this rank's copy; inside rank 0's merge_fn it must reach the other ranks."""
        if self._extended.merge_writes is not None:
            self._extended.merge_writes.append((self._synced_key, new))

    def apply_merge_write(self, payload: Any) -> None:
        xp = packing.array_module(self._local())
        self._component._value = xp.asarray(payload)

    def _mode(self, method: str) -> context.Mode:
        """The current mode; a different strategy's scope is an error."""
        mode = context.current_mode()
        if mode.kind != "default" and mode.strategy is not self._distribute_strategy:
            raise ContextError(
                f"{self._name}.{method}: this variable belongs to {self._distribute_strategy}, but the "
                f"current strategy is {mode.strategy}; use it inside its own strategy's scope()"
            )
        if (
            mode.kind == "merge"
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

    def _agreed(self, how: str, value: Any, mode: context.Mode) -> Any:
        """A cross-replica write's value, after checking every rank writes the same bytes.

        Every rank executes a cross-replica write, each with its own ``value``: one that
        differs between ranks would leave the copies silently different, so while the
        check is on the ranks compare checksums in the handshake and all raise instead.
        Writes inside ``update`` (computed from reduced values) and inside a merge_fn on rank 0
        (replayed everywhere) are not compared.
        """
        extended = self._extended
        if mode.kind == "merge" or extended.in_sync or not check_enabled(extended.collectives):
            return self._coerce(value, how)
        new: Any = None  # stays None only on a rank that raises ``error`` (then ``describe`` is not called)
        error: MpistratError | None = None
        code = 0
        try:
            new = self._coerce(value, how)
            code = mismatch.checksum(new)
        except MpistratError as exc:
            error = exc
        extended.collectives.agree(
            f"{how}({self._name})",
            fingerprint=code,
            describe=lambda: {
                "leaves": [(repr(self._name), f"value with checksum {code:016x}", tuple(new.shape))],
                "advice": _DIFFERENT_WRITES.format(name=self._name, how=how),
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
        mode = context.current_mode()
        scope = strategy.scope() if mode.kind == "default" else contextlib.nullcontext()
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
            copy._component._value = local
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
        return self._component._value

    def _write(self, how: str, value: Any) -> None:
        mode = self._mode(how)
        if mode.kind == "replica":
            self._write_in_replica(how, value)
            return
        if self._extended.in_sync:  # inside update()/update_non_slot(): this rank's copy, as it is
            self._component._write(how, value)
            return
        value = self._agreed(how, value, mode)
        self._extended.update(self, lambda v, x: v._write(how, x), args=(value,))

    def _write_in_replica(self, how: str, value: Any) -> None:
        agg = self._aggregation
        if agg is VariableAggregation.NONE:
            raise InvalidArgumentError(
                f"{self._name}.{how}: " + _AGGREGATION_HELP.format(kind="MirroredVariable")
            )
        error, local = None, None
        try:
            local = self._coerce(value, how)
        except MpistratError as exc:
            error = exc
        if local is None:
            local = packing.array_module(self._local()).zeros_like(self._local())
        combined = self._aggregate(agg, local, "variable_aggregation", error)
        self._component._value = _combine(how, self._component._value, combined)


class SyncOnReadVariable(DistributedVariable):
    """Each replica updates its own copy; reading in cross-replica context aggregates the copies."""

    def value(self) -> Any:
        mode = self._mode("value")
        local = self._component._value
        if mode.kind == "replica":
            return local
        agg = self._aggregation
        if agg is VariableAggregation.NONE:
            raise InvalidArgumentError(
                f"{self._name}: a sync-on-read variable with aggregation NONE cannot be read in "
                "cross-replica context (there is no way to combine the replicas' copies); create it with "
                "aggregation SUM, MEAN or ONLY_FIRST_REPLICA, or read it in replica context"
            )
        if mode.kind == "merge":
            if agg is VariableAggregation.ONLY_FIRST_REPLICA:
                return local  # merge_fn runs on rank 0, which holds replica 0's copy
            raise ContextError(
                f"{self._name}: a {agg.name} sync-on-read variable cannot be read inside merge_fn, which "
                "runs on rank 0 alone; read it in strategy.scope() on every rank, or pass its local value "
                "to merge_call"
            )
        return self._aggregate(agg, local, "sync_on_read")

    def _write(self, how: str, value: Any) -> None:
        mode = self._mode(how)
        if mode.kind == "replica":
            self._component._write(how, value)
            return
        sums = self._aggregation is VariableAggregation.SUM
        if how != "assign" and sums:
            raise InvalidArgumentError(  # as tf: each copy would add the delta, the sum n times it
                f"{self._name}.{how}: a sync-on-read variable with SUM aggregation does not support {how} in "
                "cross-replica context; update each replica's copy inside strategy.run, or set the summed "
                "value with assign"
            )
        new = self._agreed(how, value, mode)
        if sums:  # the copies must sum to the value
            new = self._share(new, mode)
        if how != "assign" and mode.kind == "merge":  # rank 0 alone: every rank updates its own copy
            writes = self._extended.merge_writes
            if writes is None:  # merge_call sets the list before it runs merge_fn
                raise MpistratError(f"{self._name}.{how}: a merge write outside merge_call")
            self._component._value = _combine(how, self._component._value, new)
            writes.append((self._synced_key, (how, new)))
            return
        self._component._write(how, new)

    def _share(self, total: Any, mode: context.Mode) -> Any:
        """This rank's copy of a SUM variable whose copies sum to ``total``.

        Integers are split exactly: the first ``total % size`` ranks hold one more, so that
        ``10`` over 3 ranks is 4, 3, 3 (a floor division alone would read back 9). Inside a
        merge_fn, rank 0's share is every rank's (it alone runs there).
        """
        size, xp = self._extended.size, packing.array_module(total)
        if self.dtype.kind not in "iu" or mode.kind == "merge":
            return (total / size).astype(self.dtype, copy=False)
        quotient, remainder = xp.divmod(total, size)
        return (quotient + (self._extended.rank < remainder)).astype(self.dtype, copy=False)

    def apply_merge_write(self, payload: Any) -> None:
        if isinstance(payload, tuple):  # (how, delta): applied to this rank's own copy
            how, delta = payload
            local = self._local()
            self._component._value = _combine(how, local, packing.array_module(local).asarray(delta))
            return
        super().apply_merge_write(payload)


def _refuse_replica_write(var: Variable, how: str) -> None:
    """A plain variable has one copy per process: written in a strategy's replica context, each
    rank would write its own value into its own copy, and the copies would differ silently."""
    mode = context.current_mode()
    if mode.kind == "replica" and not mode.strategy.extended.is_default:
        raise ContextError(
            f"{var.name}.{how}: this variable was created outside strategy.scope(), so each rank holds an "
            "unsynchronized copy, and writing it inside strategy.run would leave the copies different. "
            "Create it inside `with strategy.scope():` (with an aggregation), or write it outside "
            "strategy.run"
        )


def _class_to_create(synchronization: Any) -> type[Variable]:
    """Which variable ``Variable(...)`` makes here: plain outside a scope, else mirrored or sync-on-read."""
    mode = context.current_mode()
    extended = mode.strategy.extended
    colocation = context.current_colocation()
    if colocation is not None and colocation[0] is not extended:
        raise ContextError(
            "creating a variable inside colocate_vars_with() of a strategy whose scope is not active; "
            f'need to be inside "with strategy.scope()" for {colocation[0]._container_strategy}'
        )
    if extended.is_default:
        return Variable
    if mode.inside_default:
        raise ContextError(  # a RuntimeError, as tf's
            f"Mixing different Strategy objects: creating a variable in {mode.strategy}'s scope, which "
            "is inside the default strategy's scope(); leave the default strategy's scope first"
        )
    if mode.kind == "merge":
        raise ContextError(
            "cannot create a distributed variable inside merge_fn: it runs on rank 0 alone and creation is "
            "collective; create variables in strategy.scope() or in replica context before merge_call"
        )
    sync = enum_member(VariableSynchronization, synchronization, "synchronization")
    return SyncOnReadVariable if sync is VariableSynchronization.ON_READ else MirroredVariable


def _initial(initial_value: Any, dtype: Any, name: str) -> Any:
    if callable(initial_value) and not isinstance(initial_value, Variable):
        initial_value = initial_value()
    if isinstance(initial_value, Variable):
        initial_value = initial_value.value()
    if isinstance(initial_value, DistributedValues):
        raise InvalidArgumentError(
            f"Variable {name!r}: initial_value must be an array or number; got {initial_value!r}"
        )
    xp = packing.array_module(initial_value)
    try:
        arr = xp.array(initial_value, dtype=None if dtype is None else np.dtype(dtype), copy=True)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"Variable {name!r}: cannot make an array of {initial_value!r}: {exc}"
        ) from None
    return packing.as_array(arr, f"Variable {name!r}")


class _Writable:
    """``with var._writable() as arr:`` (a class, not a generator: it runs per step and variable)."""

    __slots__ = ("var",)

    def __init__(self, var: Variable):
        self.var = var

    def __enter__(self) -> Any:
        var = self.var
        if not var._private():  # held elsewhere: write into a copy
            var._value = var._value.copy()
        return var._value

    def __exit__(self, *exc_info: Any) -> None:
        self.var._set(self.var._value)


class _Probe:
    """Counts the references a variable's value has in ``Variable._private`` when nothing else holds it."""

    def __init__(self) -> None:
        self._value = np.empty(1)

    def count(self) -> int:
        return sys.getrefcount(self._value)


_PRIVATE = _Probe().count()


def _combine(how: str, old: Any, value: Any) -> Any:
    if how == "assign":
        return value
    new = old + value if how == "assign_add" else old - value
    # an array, never a NumPy scalar (what 0-d arithmetic gives): values are updated in place
    return packing.array_module(old).asarray(new, dtype=old.dtype)


def _to_numpy(arr: Any) -> np.ndarray:
    return np.asarray(arr) if packing.array_module(arr) is np else arr.get()


def _rebuild_plain(value: np.ndarray, name: str, trainable: bool) -> Variable:
    return Variable._plain(value, name, trainable)
