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

__all__ = ["DistributedValues", "PerReplica", "Mirrored"]


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
