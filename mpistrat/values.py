"""Distributed values: one value per replica.

On MPI each rank holds its own replica's value, so in the SPMD program a
per-replica value is simply the local array. ``PerReplica`` appears where one
process holds every replica's value: the arguments of a ``merge_fn`` on rank 0.

>>> v = PerReplica((1.0, 2.0))
>>> v.values
(1.0, 2.0)
"""

from __future__ import annotations

import operator
from typing import Any

from mpistrat.errors import InvalidArgumentError

__all__ = [
    "DistributedValues",
    "PerReplica",
    "Mirrored",
    "HasLocalCopy",
    "local_copy",
    "local_variable",
    "component",
]


class HasLocalCopy:
    """Marker base of variables: what collectives and reductions read from one.

    A variable in a collective counts as this rank's own copy of it, as tf.distribute
    reads a variable in a reduction (a sync-on-read variable: this replica's copy, not
    the aggregate). Recognise variables by this base, not by their attributes.
    """

    __slots__ = ()

    def _local_copy(self) -> Any:
        """This rank's copy, as an array, without communicating."""
        raise NotImplementedError

    def _local_variable(self) -> Any:
        """The variable holding this rank's copy (itself unless it is distributed)."""
        return self


def local_copy(value: Any) -> Any:
    """``value``'s local copy if it is a variable, else ``value`` itself.

    >>> local_copy(2.0)
    2.0
    """
    return value._local_copy() if isinstance(value, HasLocalCopy) else value


def local_variable(value: Any) -> Any:
    """The variable holding this rank's copy of ``value`` if it is a variable (a plain variable
    holds its own), else ``value`` itself.

    >>> local_variable("not a variable")
    'not a variable'
    """
    return value._local_variable() if isinstance(value, HasLocalCopy) else value


class DistributedValues:
    """Base class for values with one component per replica."""

    def __init__(self, values: tuple[Any, ...] | list[Any]):
        self._values = tuple(values)

    @property
    def values(self) -> tuple[Any, ...]:
        """The components, in replica order."""
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"


class PerReplica(DistributedValues):
    """Values that may differ between replicas."""


class Mirrored(DistributedValues):
    """Values known to be identical on every replica; reading it gives that value.

    >>> Mirrored((3, 3)).value
    3
    """

    @property
    def value(self) -> Any:
        return self._values[0]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        import numpy as np

        arr = np.asarray(self._values[0])
        return arr.astype(dtype) if dtype is not None else (arr.copy() if copy else arr)


def _mirrored_binary(op: Any, reflected: bool = False) -> Any:
    def method(self: Mirrored, other: Any) -> Any:
        other = other.value if isinstance(other, Mirrored) else other
        return op(other, self.value) if reflected else op(self.value, other)

    return method


# As tf's Mirrored converts to a tensor: ``strategy.extended.reduce_to(...) * learning_rate`` inside
# a merge_fn is arithmetic on the value every replica holds, and gives a plain value.
for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul"):
    _op = getattr(operator, _name)
    setattr(Mirrored, f"__{_name}__", _mirrored_binary(_op))
    setattr(Mirrored, f"__r{_name}__", _mirrored_binary(_op, reflected=True))
for _name, _op in {"and": operator.and_, "or": operator.or_, "xor": operator.xor}.items():
    # as tf's DistributedDelegate: bitwise operators on the value
    setattr(Mirrored, f"__{_name}__", _mirrored_binary(_op))
    setattr(Mirrored, f"__r{_name}__", _mirrored_binary(_op, reflected=True))


def _mirrored_pow(self: Mirrored, other: Any, modulo: Any = None) -> Any:
    return pow(self.value, other.value if isinstance(other, Mirrored) else other, modulo)


setattr(Mirrored, "__pow__", _mirrored_pow)  # noqa: B010  (three-argument pow, as tf's DistributedDelegate)
for _name in ("lt", "le", "gt", "ge"):
    setattr(Mirrored, f"__{_name}__", _mirrored_binary(getattr(operator, _name)))
for _name, _unary in {
    "neg": operator.neg,
    "pos": operator.pos,
    "abs": operator.abs,
    "invert": operator.invert,
}.items():
    setattr(Mirrored, f"__{_name}__", lambda self, _op=_unary: _op(self.value))
del _name, _op, _unary


def component(value: Any, replica: int, num_replicas: int, method: str) -> Any:
    """Replica ``replica``'s part of ``value``: its component of a ``PerReplica`` (one with a single
    component is that component for every replica), the value of a ``Mirrored``, else ``value``.

    >>> component(PerReplica((1.0, 2.0)), 1, 2, "run")
    2.0
    """
    if isinstance(value, PerReplica):
        count = len(value.values)
        if count == num_replicas or count == 1:
            return value.values[replica if count > 1 else 0]
        raise InvalidArgumentError(
            f"{method}: a PerReplica value has {count} components; expected 1 or {num_replicas} "
            "(one per replica)"
        )
    if isinstance(value, Mirrored):
        return value.values[0]
    return value
