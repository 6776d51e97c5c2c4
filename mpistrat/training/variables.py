"""Variables as ``tf.Variable``: the plain :class:`Variable`, and what every variable shares.

``Variable(...)`` outside any strategy scope is a plain variable. Inside
``strategy.scope()`` (or ``strategy.run``) it is a distributed one, a ``MirroredVariable``
or a ``SyncOnReadVariable`` (see :mod:`mpistrat.training.distributed_variables`, which
tells this module which to make).

>>> import mpistrat, numpy as np
>>> v = mpistrat.Variable(np.zeros(2))
>>> v.assign_add([1.0, 2.0]).numpy()
array([1., 2.])
>>> (v * 2).tolist()
[2.0, 4.0]
"""

from __future__ import annotations

import enum
import operator
import sys
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from mpistrat.comm import packing
from mpistrat.errors import ContextError, InvalidArgumentError, enum_member
from mpistrat.interface import modes
from mpistrat.values import DistributedValues, HasLocalCopy, Mirrored, PerReplica

__all__ = [
    "Variable",
    "VariableSynchronization",
    "VariableAggregation",
    "Writable",
    "combine",
    "plain_variable",
    "read_only",
    "set_class_chooser",
    "to_numpy",
    "writable_in_place",
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


class Owner(Protocol):
    """The distributed variable a plain variable is the local copy of
    (``training/distributed_variables.py``): told of every write to the copy."""

    def note_write(self, new: Any) -> None: ...


class Storage(Protocol):
    """The flat buffer a plain variable's array is a slice of (``training/flat_storage.py``)."""

    members: list[Any]

    def private(self, member: Any) -> bool: ...

    def start_of(self, member: Any) -> int: ...


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

    owner: Owner | None = None  # the distributed variable this copy belongs to
    _distribute_strategy: Any = None
    storage: Storage | None = None  # the optimizer's flat array this copy is a slice of, if any
    _constraint: Callable[[Any], Any] | None = None
    colocated_with: Any = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Variable:
        if cls is Variable:
            cls = _choose_class(kwargs.get("synchronization", VariableSynchronization.AUTO))
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
        self._name = "Variable" if name is None else str(name)
        tf_words = "Invalid variable {} mode: {} for variable: " + self._name + ". {}"  # what ports match
        self._synchronization = enum_member(
            VariableSynchronization,
            synchronization,
            tf_words.format("synchronization", synchronization, "It"),
        )
        none_means_none = VariableAggregation.NONE if aggregation is None else aggregation  # as tf
        self._aggregation = enum_member(
            VariableAggregation, none_means_none, tf_words.format("aggregation", aggregation, "It")
        )
        on_read = self._synchronization is VariableSynchronization.ON_READ
        self._trainable = (not on_read) if trainable is None else bool(trainable)  # ON_READ may train, as tf
        self._value = _initial(initial_value, dtype, self._name)
        colocation = modes.current_colocation()
        self.colocated_with = None if colocation is None else colocation[1]

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

    @property
    def local_array(self) -> Any:
        """This rank's array as it is, writable, never communicating: what mpistrat's optimizers,
        checkpoints and distributed variables read, update in place and replace (setting it tells
        nobody). A program reads :meth:`value` (read-only) and writes with :meth:`assign`."""
        return self._value

    @local_array.setter
    def local_array(self, array: Any) -> None:
        self._value = array

    def _local_copy(self) -> Any:
        return self._local()

    # -- reads ------------------------------------------------------------------------

    def value(self) -> Any:
        """The current value as an array, read-only (NumPy; a CuPy array cannot be marked so: leave
        it as it is). A later write leaves it as it was; :meth:`numpy` gives a copy to change."""
        return read_only(self._value)

    def read_value(self) -> Any:
        """The current value (as :meth:`value`)."""
        return self.value()

    def numpy(self) -> np.ndarray:
        """A NumPy copy of the current value."""
        return to_numpy(self.value()).copy()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = to_numpy(self.value())
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
        if self.owner is None:  # a plain variable, not a distributed one's copy
            _refuse_replica_write(self, how)
        new = self._coerce(value, how)
        # _private() counts references: ask it before this frame holds one of its own
        if not self._private() or not writable_in_place(self._value):  # held: leave it as it is
            self._set(combine(how, self._value, new.copy() if how == "assign" else new))
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
        if self.storage is not None:
            return self.storage.private(self)
        return sys.getrefcount(self._value) <= _PRIVATE

    def _set(self, new: Any) -> None:
        self._value = new
        if self.owner is not None:
            self.owner.note_write(new)

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
        local = to_numpy(self._local())
        shown = local.item() if local.ndim == 0 else local
        return f"<mpistrat.Variable {self._name!r} shape={local.shape} dtype={local.dtype}, numpy={shown!r}>"

    def __reduce__(self) -> Any:
        return (_rebuild_plain, (to_numpy(self._local()), self._name, self._trainable))

    def __deepcopy__(self, memo: dict[int, Any]) -> Variable:
        """A new plain variable with a copy of the value, name, trainability and constraint."""
        copy = plain_variable(self._local().copy(), self._name, self._trainable)
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


def _refuse_replica_write(var: Variable, how: str) -> None:
    """A plain variable has one copy per process: written in a strategy's replica context, each
    rank would write its own value into its own copy, and the copies would differ silently."""
    if modes.current_mode().kind is modes.REPLICA and modes.has_strategy():
        raise ContextError(
            f"{var.name}.{how}: this variable was created outside strategy.scope(), so each rank holds an "
            "unsynchronized copy, and writing it inside strategy.run would leave the copies different. "
            "Create it inside `with strategy.scope():` (with an aggregation), or write it outside "
            "strategy.run"
        )


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


class Writable:
    """``with Writable(var) as arr:`` gives ``var``'s array to update in place (the optimizers' arithmetic).

    Its own storage when nothing else holds it; a private copy when something does (a ``value()``
    read earlier keeps its value, as a write in tf leaves earlier reads alone). A class, not a
    generator: it runs per step and variable.

    >>> v = Variable(np.zeros(2))
    >>> with Writable(v) as w:
    ...     w += 1.0
    >>> v.numpy()
    array([1., 1.])
    """

    __slots__ = ("var",)

    def __init__(self, var: Variable):
        self.var = var

    def __enter__(self) -> Any:
        var = self.var
        if not var._private() or not writable_in_place(var._value):  # held elsewhere: write into a copy
            var._value = var._value.copy()
        return var._value

    def __exit__(self, *exc_info: Any) -> None:
        var = self.var
        var._set(var._value)


class _Probe:
    """Counts the references a variable's value has in ``Variable._private`` when nothing else holds it."""

    def __init__(self) -> None:
        self._value = np.empty(1)

    def count(self) -> int:
        return sys.getrefcount(self._value)


_PRIVATE = _Probe().count()


def combine(how: str, old: Any, value: Any) -> Any:
    """``old`` after ``how`` (``"assign"``, ``"assign_add"``, ``"assign_sub"``) with ``value``."""
    if how == "assign":
        return value
    new = old + value if how == "assign_add" else old - value
    # an array, never a NumPy scalar (what 0-d arithmetic gives): values are updated in place
    return packing.array_module(old).asarray(new, dtype=old.dtype)


def read_only(arr: Any) -> Any:
    """``arr``, marked read-only if it is a NumPy array: what a read returns, so that changing it in
    place raises instead of changing one rank's copy of a variable (tf's tensors are immutable)."""
    if type(arr) is np.ndarray:
        arr.flags.writeable = False
    return arr


def writable_in_place(arr: Any) -> bool:
    """Make a variable's own array writable again after :func:`read_only` (nothing holds it now);
    False if it cannot be (its memory is read-only): then the write goes to a copy."""
    if type(arr) is not np.ndarray or arr.flags.writeable:
        return True
    try:
        arr.flags.writeable = True
    except ValueError:
        return False
    return True


def to_numpy(arr: Any) -> np.ndarray:
    """A NumPy view of a NumPy array, or a host copy of a device array."""
    return np.asarray(arr) if packing.array_module(arr) is np else arr.get()


def plain_variable(value: Any, name: str, trainable: bool = False) -> Variable:
    """A plain variable holding ``value`` as it is, outside any strategy (no scope is consulted):
    the bookkeeping variables of checkpoints, and each rank's component of a distributed one."""
    var = object.__new__(Variable)
    var._synchronization, var._aggregation = VariableSynchronization.NONE, VariableAggregation.NONE
    var._trainable, var._name, var._value = trainable, name, value
    return var


def _rebuild_plain(value: np.ndarray, name: str, trainable: bool) -> Variable:
    return plain_variable(value, name, trainable)


def _plain_class(synchronization: Any) -> type[Variable]:
    return Variable


# Which class ``Variable(...)`` makes, given its ``synchronization``: distributed_variables.py
# sets it on import (training/__init__.py imports it), since only it knows the distributed classes.
_choose_class: Callable[[Any], type[Variable]] = _plain_class


def set_class_chooser(choose: Callable[[Any], type[Variable]]) -> None:
    """Register what picks the class ``Variable(...)`` makes (plain outside a scope)."""
    global _choose_class
    _choose_class = choose
