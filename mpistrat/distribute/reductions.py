"""Every cross-replica reduction, in the two contexts it runs in; ``StrategyExtended.reducer`` picks.

:class:`SpmdReducer`: the SPMD cross-replica context (inside ``strategy.scope()``): every rank
executes, and each call is one collective over every rank's local value.

:class:`LocalReducer`: every replica's value is at hand (a root-mode ``merge_fn`` on rank 0, or
the default strategy's one replica): array arithmetic (:func:`reduce_here`), nothing sent.

``Strategy.reduce`` and ``gather``, and ``StrategyExtended.reduce_to``, ``batch_reduce_to`` and
``broadcast_to`` check their arguments, then hand them to one of the two.

>>> import numpy as np
>>> from mpistrat.options import CommunicationOptions
>>> here = LocalReducer(2, CommunicationOptions(), mirrored(2))
>>> from mpistrat.values import PerReplica
>>> here.reduce_to(ReduceOp.SUM, PerReplica((np.float64(1.0), np.float64(2.0))), None).values
(np.float64(3.0), np.float64(3.0))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat import nest
from mpistrat.comm import packing
from mpistrat.errors import ContextError, InvalidArgumentError, MpistratError, enum_member
from mpistrat.options import CommunicationOptions
from mpistrat.reduce_op import ReduceOp
from mpistrat.values import DistributedValues, HasLocalCopy, Mirrored, PerReplica, component, local_copy

if TYPE_CHECKING:
    from mpistrat.distribute.extended import StrategyExtended

__all__ = [
    "ONLY_FIRST_REPLICA",
    "LocalReducer",
    "SpmdReducer",
    "check_destinations",
    "mirrored",
    "pairs",
    "reduce_here",
    "reduce_op",
]

ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"
_CONTAINERS = (list, tuple, dict)  # what optree would walk into; anything else is a leaf here


class SpmdReducer:
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

    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None) -> Any:
        """``Strategy.reduce``: every rank's part of ``value``, all-reduced (along ``axis`` first)."""
        extended = self._extended
        collectives, rank, size = extended.collectives, extended.rank, extended.size
        try:
            op = ReduceOp.from_any(op)
            local = nest.tree_map(lambda x: component(x, rank, size, "reduce"), value)
        except MpistratError as exc:
            collectives.agree("reduce", error=exc)  # the others are entering the all_reduce: tell them
            raise
        if axis is None:
            return collectives.all_reduce(op, local, kind="reduce")
        # Exact with CommunicationOptions(deterministic=True): the same bits at any number of ranks.
        return collectives.reduce_along_axis(op, local, axis, kind="reduce")

    def gather(self, value: Any, axis: int) -> Any:
        """``Strategy.gather``: every rank's part of ``value``, concatenated along ``axis`` in rank order."""
        extended = self._extended
        local = nest.tree_map(lambda x: component(x, extended.rank, extended.size, "run"), value)
        return extended.collectives.all_gather(local, axis, kind="gather")


class LocalReducer:
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

    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None) -> Any:
        """``Strategy.reduce`` inside a merge_fn: :func:`reduce_here`."""
        return reduce_here(ReduceOp.from_any(op), value, self._size, "reduce", axis)

    def gather(self, value: Any, axis: int) -> Any:
        """``Strategy.gather`` inside a merge_fn: each leaf's replica values, concatenated."""
        return nest.tree_map(lambda v: _concatenate(local_results(v), axis), value)


# -- reducing where every replica's value is at hand ----------------------------------------


def reduce_here(op: Any, value: Any, size: int, method: str, axis: int | None = None) -> Any:
    """Reduce ``value`` (a nest; ``PerReplica`` leaves hold the replicas' values) with array arithmetic.

    The one reducer of a root-mode merge_fn (rank 0 alone) and of the default strategy:
    ``Strategy.reduce``, ``reduce_to`` and ``batch_reduce_to`` all come here. As tf.distribute:

    - a ``PerReplica`` reduces its components (SUM adds them, MEAN divides by their number);
      it must have 1 or ``size`` components;
    - a ``Mirrored`` value or mirrored variable holds one value per replica: SUM gives
      ``size`` times it (tf raises AssertionError there), MEAN the value;
    - another value is the same on every replica: MEAN gives it, SUM is an error unless
      ``size`` is 1;
    - ``"ONLY_FIRST_REPLICA"`` (``reduce_to`` only) takes replica 0's value.

    With ``axis`` each value is first summed along it; MEAN divides by the count along it.
    Float dtypes are kept; integer MEANs give float64.

    >>> reduce_here(ReduceOp.MEAN, PerReplica((np.float32(1.0), np.float32(2.0))), 2, "reduce")
    np.float32(1.5)
    """
    return nest.tree_map(
        lambda leaf: _reduce_leaf(op, leaf, size, method, axis),
        value,
        is_leaf=lambda x: isinstance(x, DistributedValues),
    )


def _reduce_leaf(op: Any, leaf: Any, size: int, method: str, axis: int | None) -> Any:
    if isinstance(leaf, HasLocalCopy):
        if isinstance(leaf, DistributedValues) and not leaf.mirrored:  # type: ignore[attr-defined]
            raise ContextError(
                f"{method}: a sync-on-read variable cannot be reduced inside merge_fn, which runs on rank 0 "
                "alone with only rank 0's copy; reduce it in strategy.scope() on every rank, or use "
                "MPIStrategy(merge_call='every_rank')"
            )
        leaf = Mirrored((local_copy(leaf),)) if isinstance(leaf, DistributedValues) else local_copy(leaf)
    if isinstance(leaf, PerReplica):
        parts = list(leaf.values)
        if len(parts) not in (1, size):
            raise InvalidArgumentError(
                f"{method}: a PerReplica value has {len(parts)} components; expected 1 or {size} "
                "(one per replica)"
            )
    elif isinstance(leaf, Mirrored):
        parts = [leaf.values[0]] * (size if op == ReduceOp.SUM else 1)
    elif op == ReduceOp.SUM and size > 1:
        raise InvalidArgumentError(
            f"{method}: a value that is not a PerReplica (the same on every replica) cannot be reduced "
            f"with SUM across {size} replicas inside merge_fn; pass the PerReplica value merge_fn received"
        )
    else:
        parts = [leaf]
    if op == "ONLY_FIRST_REPLICA":
        return parts[0]
    try:
        return nest.tree_map(lambda *xs: _combine(op, xs, axis, method), *parts)
    except ValueError as exc:  # components of different structures
        raise InvalidArgumentError(f"{method}: the components of a PerReplica value differ: {exc}") from None


def _combine(op: Any, parts: tuple[Any, ...], axis: int | None, method: str) -> Any:
    xp = packing.common_module(parts)
    arrays = [xp.asarray(p) for p in parts]
    count = len(arrays)
    if axis is not None:
        for a in arrays:
            if not -a.ndim <= axis < a.ndim:
                raise InvalidArgumentError(f"{method}: axis {axis} is out of range for shape {a.shape}")
        count = sum(a.shape[axis] for a in arrays)
        arrays = [a.sum(axis=axis, dtype=a.dtype) for a in arrays]
    if len({a.shape for a in arrays}) > 1:  # NumPy would broadcast them into a wrong answer
        shapes = ", ".join(f"replica {r}: {tuple(a.shape)}" for r, a in enumerate(arrays))
        along = "" if axis is None else f" after summing along axis {axis}"
        raise InvalidArgumentError(
            f"{method}: the replicas' values have different shapes{along} ({shapes}); every replica must "
            "pass the same shape (for batches of different sizes, reduce along the batch axis with axis=0)"
        )
    total = arrays[0]
    for a in arrays[1:]:
        total = total + a
    if op != ReduceOp.MEAN:
        return total
    from mpistrat.collectives.reduce_axis import mean_of  # one rule for a mean's dtype, the collectives'

    return mean_of(total, count)


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
    """What :class:`LocalReducer` wraps a result in on a strategy of ``size`` replicas: a ``Mirrored``."""
    return lambda value: Mirrored((value,) * size)


def _local(value: Any, rank: int, size: int, method: str) -> Any:
    """This rank's component of a distributed value (SPMD context); a variable's local copy."""

    def one(x: Any) -> Any:
        return local_copy(component(x, rank, size, method))

    if not isinstance(value, _CONTAINERS):  # one leaf (a gradient): no tree walk
        return one(value)
    return nest.tree_map(one, value)


def local_results(value: Any) -> tuple[Any, ...]:
    """The replicas' values of ``value`` held here (``experimental_local_results``): a distributed
    value's components, else the value itself."""
    if isinstance(value, DistributedValues):
        return tuple(value.values)
    return (value,)


def _concatenate(components: Any, axis: int) -> Any:
    xp = packing.common_module(components)
    return xp.concatenate([xp.asarray(c) for c in components], axis=axis)
