"""What a strategy's recovery repairs after a rank died: the objects that registered with its collectives.

A distributed variable, an optimizer and a distributed iterator each register with the
``Collectives`` of their strategy when they are made (on every rank, in the same order). When a
rank dies, the strategy's recovery (``distribute/recovery.py``) asks each for its
:meth:`~Recoverable.recovery_facts` (a small picklable value, gathered from every survivor), settles
the step the survivors go on from, rebuilds the collectives on the survivors, then calls each
one's :meth:`~Recoverable.recover` in registration order: the same order on every rank, since
``recover`` may communicate.

>>> class Counter:
...     def recovery_facts(self): return 1
...     def recover(self, recovery, facts): pass
>>> registry = Recoverables()
>>> c = Counter(); registry.add(c)
>>> [(key, type(r).__name__) for key, r in registry.items()], isinstance(c, Recoverable)
([(0, 'Counter')], True)
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Protocol, runtime_checkable

__all__ = ["Recoverable", "Recoverables"]


@runtime_checkable
class Recoverable(Protocol):
    """What the recovery asks of a registered object."""

    def recovery_facts(self) -> Any:
        """What the survivors must know of this object on this rank (small, picklable; no communication)."""
        ...

    def recover(self, recovery: Any, facts: list[Any]) -> None:
        """Go on over the survivors (collective over them): ``recovery`` is the strategy's
        ``distribute.recovery.Recovery``, ``facts`` every survivor's of this object, in rank order."""
        ...


class Recoverables:
    """The objects to repair, weakly held (a dropped variable is not kept alive), in registration order."""

    def __init__(self) -> None:
        self._objects: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._keys = itertools.count()

    def add(self, *objects: Recoverable | None) -> None:
        """Register ``objects`` in this order (None: nothing)."""
        for obj in objects:
            if obj is not None:
                self._objects[next(self._keys)] = obj

    def items(self) -> list[tuple[int, Any]]:
        """The live objects and their keys, in the order they registered. Every rank numbers them
        alike; an object one rank has dropped and another not (collected at another time) is left
        out by the recovery, which repairs only the keys every survivor holds."""
        return [(k, o) for k in sorted(self._objects.keys()) if (o := self._objects.get(k)) is not None]
