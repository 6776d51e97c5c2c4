"""Distributed values: one value per replica.

On MPI each rank holds its own replica's value, so in the SPMD program a
per-replica value is simply the local array. ``PerReplica`` appears where one
process holds every replica's value: the arguments of a ``merge_fn`` on rank 0.

>>> v = PerReplica((1.0, 2.0))
>>> v.values
(1.0, 2.0)
"""

from __future__ import annotations

from typing import Any

from mpistrat.errors import InvalidArgumentError

__all__ = ["DistributedValues", "PerReplica", "Mirrored", "HasLocalCopy", "local_copy", "component"]


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
