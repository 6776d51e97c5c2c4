"""Flat storage: variables whose values are slices of one contiguous array.

An optimizer keeps the variables it updates, and their slots, in one flat array per
dtype, so that a step updates all of them in a few vectorised passes. Each variable
stays a ``Variable`` whose value is a view of its slice.

Copy-on-write is kept. :meth:`FlatBuffer.claim` hands out the array for an in-place
write only once nothing outside holds a view of it (a ``value()`` read earlier, a
slice of one, ``np.asarray(v)``, a memoryview). If something does, the array is
copied first and the variables move to the copy, so what was read keeps its value.
A variable that was given a new array of its own (an ``assign`` while its value was
held, a merge write, a restore) is copied back into its slice by the next ``claim``.

>>> import numpy as np
>>> from mpistrat.training.variables import Variable
>>> a, b = Variable(np.ones(2)), Variable(np.zeros((1, 2)))
>>> buf = FlatBuffer([a, b])
>>> buf.array
array([1., 1., 0., 0.])
>>> kept = a.value()
>>> buf.claim()[:] = 5.0
>>> kept, a.numpy(), b.numpy()
(array([1., 1.]), array([5., 5.]), array([[5., 5.]]))
"""

from __future__ import annotations

import math
import operator
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat.comm import packing
from mpistrat.errors import InvalidArgumentError
from mpistrat.training import placement

if TYPE_CHECKING:
    from mpistrat.training.variables import Variable

__all__ = ["FlatBuffer", "spans"]


def spans(shapes: list[tuple[int, ...]]) -> list[tuple[int, int]]:
    """The ``(start, stop)`` of each shape's elements laid end to end.

    >>> spans([(2, 3), (), (4,)])
    [(0, 6), (6, 7), (7, 11)]
    """
    out, start = [], 0
    for shape in shapes:
        stop = start + math.prod(shape)
        out.append((start, stop))
        start = stop
    return out


class FlatBuffer:
    """One flat array holding ``members``' values end to end (then ``length - size`` zeros).

    Args:
        members: plain variables (a distributed variable's local copy), one dtype.
        length: the array's length, at least the members' total size (padding for sharding).
    """

    def __init__(self, members: list[Variable], length: int = 0):
        values = [m.local_array for m in members]
        self.members = members
        self.shapes = [tuple(v.shape) for v in values]
        self.dtype = values[0].dtype
        self.spans = spans(self.shapes)
        self.size = self.spans[-1][1]
        self.xp = packing.array_module(values[0])
        self._index = {id(m): i for i, m in enumerate(members)}
        array = placement.zeros(max(length, self.size), self.dtype, self.xp)
        for value, (a, b) in zip(values, self.spans, strict=True):
            array[a:b] = value.reshape(-1)
        self.views: list[Any] = []
        self._bind(array)

    def _bind(self, array: Any) -> None:
        """Make ``array`` the storage: every member's value becomes a view of its slice."""
        self.array = array
        self.views = [array[a:b].reshape(s) for (a, b), s in zip(self.spans, self.shapes, strict=True)]
        for member, view in zip(self.members, self.views, strict=True):
            member.local_array = view
            member.storage = self

    # Reference counts, read always through these three methods: the baselines below are read
    # through them too (on a probe nobody else holds), so they hold for any Python's counting.
    def _array_refs(self) -> int:
        """References to the array beyond its views' (a slice of a view is based on the array)."""
        return sys.getrefcount(self.array) - len(self.views)

    def _view_refs(self) -> list[int]:
        return list(map(sys.getrefcount, self.views))

    def _view_refs_at(self, i: int) -> int:
        return sys.getrefcount(self.views[i])

    def _held(self, attached: list[bool]) -> bool:
        """Whether something outside holds the array, a view of it, or a member's slice (whose
        view has one reference fewer once its member has another value: not ``attached``)."""
        if self._array_refs() > _ARRAY_REFS:
            return True
        counts = self._view_refs()
        if all(attached):
            return max(counts) > _VIEW_REFS
        return any(c > _VIEW_REFS - (not a) for c, a in zip(counts, attached, strict=True))

    def claim(self) -> Any:
        """The array, safe to write in place (see the module's docstring); its members follow it.

        Raises ``InvalidArgumentError`` if a member's value changed shape or dtype.
        """
        views, members = self.views, self.members
        attached = list(map(operator.is_, map(_VALUE, members), views))
        detached = [] if all(attached) else [i for i, a in enumerate(attached) if not a]
        moved = {i: members[i].local_array for i in detached}
        for i, value in moved.items():
            if tuple(value.shape) != self.shapes[i] or value.dtype != self.dtype:
                raise InvalidArgumentError(
                    f"variable {members[i].name!r} is now {value.dtype}{list(value.shape)}; the optimizer "
                    f"holds it as {self.dtype}{list(self.shapes[i])} since its first step. A variable "
                    "keeps its shape and dtype; make a new variable (and optimizer) instead"
                )
        held = self._held(attached)
        if held or detached:
            self._bind(placement.copy(self.array) if held else self.array)
        for i, value in moved.items():  # through the array: a view may have been read (read-only)
            a, b = self.spans[i]
            self.array[a:b] = value.reshape(-1)
        return self.array

    def start_of(self, member: Variable) -> int:
        """The element at which ``member``'s slice begins."""
        return self.spans[self._index[id(member)]][0]

    def private(self, member: Variable) -> bool:
        """Whether ``member``'s slice may be written in place (nothing outside holds it)."""
        i = self._index[id(member)]
        if member.local_array is not self.views[i]:
            return False
        return self._view_refs_at(i) <= _VIEW_REFS_AT and self._array_refs() <= _ARRAY_REFS


_VALUE = operator.attrgetter("local_array")


class _Member:
    def __init__(self, value: Any):
        self.local_array, self.name = value, "probe"


def _baselines() -> tuple[int, int, int]:
    """The counts of a buffer whose array and views nobody else holds, as this Python counts them."""
    probe = FlatBuffer([_Member(np.zeros(1))])  # type: ignore[list-item]
    return probe._array_refs(), max(probe._view_refs()), probe._view_refs_at(0)


_ARRAY_REFS, _VIEW_REFS, _VIEW_REFS_AT = _baselines()
