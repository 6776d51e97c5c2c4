"""Cross-replica reductions in the two contexts they run in; ``StrategyExtended`` picks one per call.

:class:`Collective`: the SPMD cross-replica context (inside ``strategy.scope()``): every rank
executes, and each call is one collective over every rank's local value.

:class:`InPlace`: every replica's value is at hand (a root-mode ``merge_fn`` on rank 0, or the
default strategy's one replica): array arithmetic (:func:`~mpistrat.distribute.merge.reduce_here`),
nothing sent.

>>> import numpy as np
>>> from mpistrat.options import CommunicationOptions
>>> here = InPlace(2, CommunicationOptions(), mirrored(2))
>>> from mpistrat.values import PerReplica
>>> here.reduce_to(ReduceOp.SUM, PerReplica((np.float64(1.0), np.float64(2.0))), None).values
(np.float64(3.0), np.float64(3.0))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat import nest
from mpistrat.distribute.merge import reduce_here
from mpistrat.errors import InvalidArgumentError, MpistratError, enum_member
from mpistrat.options import CommunicationOptions
from mpistrat.reduce_op import ReduceOp
from mpistrat.values import DistributedValues, HasLocalCopy, Mirrored, component, local_copy

if TYPE_CHECKING:
    from mpistrat.distribute.extended import StrategyExtended

__all__ = [
    "Collective",
    "InPlace",
    "ONLY_FIRST_REPLICA",
    "check_destinations",
    "mirrored",
    "pairs",
    "reduce_op",
]

ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"
_CONTAINERS = (list, tuple, dict)  # what optree would walk into; anything else is a leaf here


class Collective:
    """The SPMD context's reductions: one collective each (an error on one rank reaches every rank).

    Args:
        extended: whose collectives (raising once it was finalized), rank, size and options are used.
    """

    def __init__(self, extended: StrategyExtended):
        self._extended = extended

    def reduce_to(self, op: str | ReduceOp, value: Any, options: CommunicationOptions | None) -> Any:
        return self.batch_reduce_to(op, value, options, "reduce_to")

    def batch_reduce_to(
        self,
        op: str | ReduceOp,
        value: Any,
        options: CommunicationOptions | None,
        kind: str = "batch_reduce_to",
    ) -> Any:
        """One collective over every rank's part of ``value`` (a batch: the list of the values)."""
        extended, local, error = self._extended, None, None
        try:
            local = _local(value, extended.rank, extended.size, kind)
            if options is not None:
                extended.communication_options.merge(options)  # a wrong type here reaches every rank
        except MpistratError as exc:
            error, options = exc, None
        if op == ONLY_FIRST_REPLICA:  # replica 0's value: a broadcast, not a sum with zeros
            return extended.collectives.broadcast(local, kind=kind, error=error)
        return extended.collectives.all_reduce(op, local, options, kind=kind, error=error)

    def broadcast_to(self, tensor: Any) -> Any:
        return self._extended.collectives.broadcast(tensor, kind="broadcast_to")


class InPlace:
    """Reductions where every replica's value is at hand: array arithmetic, nothing sent.

    Args:
        size: the number of replicas.
        options: the strategy's ``CommunicationOptions`` (an ``options=`` argument is checked against
            them, and unused: nothing is communicated).
        mirrored: wraps a result that every replica holds (``Mirrored``; the default strategy's one
            replica takes the value as it is).
    """

    def __init__(self, size: int, options: CommunicationOptions, mirrored: Callable[[Any], Any]):
        self._size, self._options, self._mirrored = size, options, mirrored

    def reduce_to(self, op: str | ReduceOp, value: Any, options: CommunicationOptions | None) -> Any:
        self._options.merge(options)  # a wrong type is an error here too
        return self._mirrored(reduce_here(op, value, self._size, "reduce_to"))

    def batch_reduce_to(
        self, op: str | ReduceOp, values: list[Any], options: CommunicationOptions | None
    ) -> list[Any]:
        self._options.merge(options)
        return [self._mirrored(reduce_here(op, v, self._size, "batch_reduce_to")) for v in values]

    def broadcast_to(self, tensor: Any) -> Any:
        return self._mirrored(tensor)


# -- the arguments' checks, before either context's reduction -------------------------------


def reduce_op(op: Any, method: str) -> str | ReduceOp:
    """A ReduceOp, or ONLY_FIRST_REPLICA, from a ReduceOp, a VariableAggregation or a name."""
    name = getattr(op, "name", op)
    if isinstance(name, str) and name.upper() == ONLY_FIRST_REPLICA:
        return ONLY_FIRST_REPLICA
    choices = "ReduceOp.SUM/MEAN, VariableAggregation.SUM/MEAN/ONLY_FIRST_REPLICA or one of their names"
    return enum_member(ReduceOp, name, f"{method}: reduce_op", choices, given=op)


def check_destinations(destinations: Any, method: str) -> None:
    """Raise unless ``destinations`` is a variable, a distributed value, a value or a device string."""
    ok = (
        isinstance(destinations, (DistributedValues, np.ndarray, np.generic))
        or type(destinations) in (bool, int, float, complex)  # a value passed as its own destination
        or isinstance(destinations, HasLocalCopy)  # a variable
        or type(destinations).__module__.startswith("cupy")
    )
    if isinstance(destinations, str):
        ok = bool(destinations)
    if not ok:
        raise InvalidArgumentError(
            f"{method}: destinations must be a variable, a distributed value or a device string "
            f"(not a list, tuple or None); got {destinations!r}"
        )


def pairs(value_destination_pairs: Any) -> list[tuple[Any, Any]]:
    """``batch_reduce_to``'s ``(value, destinations)`` pairs, checked."""
    pairs = list(value_destination_pairs)
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InvalidArgumentError(
                f"batch_reduce_to: value_destination_pairs[{i}] must be a (value, destinations) pair; "
                f"got {pair!r}"
            )
        check_destinations(pair[1], "batch_reduce_to")
    return [tuple(p) for p in pairs]


def mirrored(size: int) -> Callable[[Any], Mirrored]:
    """What :class:`InPlace` wraps a result in on a strategy of ``size`` replicas: a ``Mirrored``."""
    return lambda value: Mirrored((value,) * size)


def _local(value: Any, rank: int, size: int, method: str) -> Any:
    """This rank's component of a distributed value (SPMD context); a variable's local copy."""

    def one(x: Any) -> Any:
        return local_copy(component(x, rank, size, method))

    if not isinstance(value, _CONTAINERS):  # one leaf (a gradient): no tree walk
        return one(value)
    return nest.tree_map(one, value)
