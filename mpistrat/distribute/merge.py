"""merge_call's two modes: on rank 0 alone (the default), or on every rank.

``"root"``: every rank's arguments are gathered to rank 0, where array leaves and
leaves that differ become ``PerReplica`` values holding every replica's value;
``merge_fn`` runs there once, in a *merge* context where reductions are local
arithmetic. Its result is broadcast, except ``PerReplica`` leaves, whose components
are scattered (each rank receives only its own); writes it made to distributed
variables are broadcast and replayed. Any merge_fn works, at the cost of a funnel
through rank 0: use it for coordination and for merge functions that need every
replica's value at once.

``"every_rank"``: ``merge_fn`` runs on every rank, as tf.distribute's
MultiWorkerMirroredStrategy runs it on every worker. Array arguments become
``PerReplica`` values holding this rank's own value; reductions inside
(``reduce_to``, ``batch_reduce_to``, ``Strategy.reduce``) are collectives and
``update`` writes each rank's copy, so the variable-update pattern costs one
all-reduce per rank, at any number of ranks. Variables (slots) may be created
inside. ``merge_fn`` must then make the same collective calls on every rank. The
optimizers use neither: they step in the replica context, without ``merge_call``.

>>> import mpistrat, numpy as np
>>> ctx = mpistrat.get_replica_context()
>>> ctx.merge_call(lambda strategy, x: strategy.reduce("sum", x), args=(np.ones(2),))
array([1., 1.])
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat import nest
from mpistrat.collectives import check_level
from mpistrat.collectives.fingerprint import checksum, code_of
from mpistrat.errors import (
    InvalidArgumentError,
    MpistratError,
    StructureMismatchError,
    UnsupportedTypeError,
)
from mpistrat.interface import modes
from mpistrat.values import DistributedValues, Mirrored, PerReplica

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives
    from mpistrat.distribute.strategy_base import Strategy

__all__ = ["merge_on_root", "merge_on_every_rank", "regroup", "select"]


class _SameEverywhere:
    """Stands in for a value every rank already holds (a mirrored value or variable)."""


# Placeholders in the broadcast part of a merge_fn result: component ``index`` of a
# PerReplica leaf (each rank receives its own components by scatter), and a distributed
# variable (each rank takes its own object with that key).
_Component = collections.namedtuple("_Component", "index")
_Synced = collections.namedtuple("_Synced", "key")


class _TheStrategy:
    """Stands in for the strategy (or its ``extended``) in a merge_fn's result: every rank has its
    own, and it cannot be pickled (``merge_call(lambda strategy: strategy)`` is a barrier idiom)."""

    def __init__(self, extended: bool):
        self.extended = extended


# -- "root" -------------------------------------------------------------------------------


def merge_on_root(strategy: Strategy, merge_fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Gather to rank 0, run ``merge_fn`` there, broadcast (scatter ``PerReplica`` leaves)."""
    extended = strategy.extended
    collectives = extended.collectives
    rank = extended.rank
    local = (tuple(args), kwargs)
    gathered = collectives.gather_to_root(nest.tree_map(_strip_shared, local))
    components: list[list[Any]] = []

    def run() -> tuple[Any, list[tuple[int, Any]], bool]:  # on rank 0 alone
        nonlocal components
        if gathered is None:  # gather_to_root returns the list on rank 0, where run() runs
            raise MpistratError("merge_call: rank 0 holds no gathered arguments")
        m_args, m_kwargs = regroup(local, gathered)
        record = extended.writes  # the writes merge_fn makes to the strategy's variables
        writes = record.record()
        try:
            with modes.push(modes.Mode(strategy, None, modes.MERGE)):
                result = merge_fn(strategy, *m_args, **m_kwargs)
        finally:
            record.stop()
        shared, components = _split_result(result, collectives.size, strategy)
        return shared, writes, bool(components[0])

    shared, writes, scattered = collectives.on_root(run, kind="merge_call (result)")
    if rank != 0:
        extended.apply_merge_writes(writes)
    mine = []
    if scattered:
        mine = collectives.scatter_from_root(
            components if rank == 0 else None, kind="merge_call (components)"
        )
    return nest.tree_map(
        lambda x: _fill(x, mine, strategy),
        shared,
        is_leaf=lambda x: isinstance(x, (_Component, _Synced, _TheStrategy)),
    )


def _strip_shared(leaf: Any) -> Any:
    if isinstance(leaf, DistributedValues) and not isinstance(leaf, PerReplica):
        return _SameEverywhere()
    return leaf


def regroup(local: Any, gathered: list[Any]) -> Any:
    """Rank 0's args with each leaf replaced by ``PerReplica`` of every rank's value."""
    import optree  # loaded already: the arguments were walked to be sent

    from mpistrat.collectives.objects import Unsendable  # loaded already: ``gathered`` came through it

    leaves, spec = nest.tree_flatten(local)
    per_rank = [leaves]
    for r, other in enumerate(gathered[1:], start=1):
        if isinstance(other, Unsendable):
            raise UnsupportedTypeError(f"rank {r}: {other.message}")
        other_leaves, other_spec = nest.tree_flatten(other)
        if other_spec != spec:
            raise StructureMismatchError(
                f"merge_call: rank {r} passed arguments of a different structure than rank 0 "
                f"({other_spec} vs {spec}); every replica must pass the same structure"
            )
        per_rank.append(other_leaves)
    merged = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, DistributedValues) and not isinstance(leaf, PerReplica):
            merged.append(leaf)
            continue
        values = [r[i] for r in per_rank]
        if _is_data(leaf) or not _all_equal(values):
            merged.append(PerReplica(values))
        else:
            merged.append(leaf)
    return optree.tree_unflatten(spec, merged)


def _is_data(leaf: Any) -> bool:
    return isinstance(leaf, (np.ndarray, np.generic)) or type(leaf).__module__.startswith("cupy")


def _all_equal(values: list[Any]) -> bool:
    first = values[0]
    try:
        return all(type(v) is type(first) and bool(v == first) for v in values[1:])
    except Exception:
        return False


def _split_result(result: Any, size: int, strategy: Any = None) -> tuple[Any, list[list[Any]]]:
    """(what every rank gets, each rank's list of components of the ``PerReplica`` leaves).

    What every rank holds already travels as a placeholder, never pickled: the strategy and
    its ``extended``, distributed variables (by key), a ``Mirrored``'s value when it is one.
    """
    components: list[list[Any]] = [[] for _ in range(size)]

    def split(leaf: Any) -> Any:
        if strategy is not None and leaf is strategy:
            return _TheStrategy(extended=False)
        if strategy is not None and leaf is strategy.extended:
            return _TheStrategy(extended=True)
        if isinstance(leaf, PerReplica) and len(leaf.values) > 1:
            if len(leaf.values) != size:
                raise InvalidArgumentError(
                    f"merge_call: merge_fn returned a PerReplica with {len(leaf.values)} components; "
                    f"expected 1 or {size} (one per replica)"
                )
            for r, value in enumerate(leaf.values):
                components[r].append(value)
            return _Component(len(components[0]) - 1)
        if isinstance(leaf, (PerReplica, Mirrored)):  # one value for all, as tf's select_replica gives
            return leaf.values[0]
        key = getattr(leaf, "synced_key", None)
        if isinstance(leaf, DistributedValues) and key is not None:
            return _Synced(key)
        return leaf

    return nest.tree_map(split, result), components


def _fill(leaf: Any, mine: list[Any], strategy: Strategy) -> Any:
    if isinstance(leaf, _TheStrategy):
        return strategy.extended if leaf.extended else strategy
    if isinstance(leaf, _Synced):
        return strategy.extended.synced(leaf.key)
    if isinstance(leaf, _Component):
        return mine[leaf.index]
    return leaf


# -- "every_rank" -------------------------------------------------------------------------


def merge_on_every_rank(strategy: Strategy, merge_fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Run ``merge_fn`` on every rank with its own values; the ranks agree on the outcome after."""
    extended = strategy.extended
    collectives = extended.collectives
    m_args, m_kwargs = nest.tree_map(_own, (tuple(args), kwargs))
    error: BaseException | None = None
    disagreements = collectives.disagreements
    record = extended.writes  # the writes merge_fn makes to the strategy's variables
    written = record.record()
    try:
        with modes.push(modes.Mode(strategy, None, modes.CROSS_REPLICA)):
            result = merge_fn(strategy, *m_args, **m_kwargs)
    except BaseException as exc:
        error = exc
    finally:
        record.stop()
    # A collective inside merge_fn that failed on every rank (a rank that raised early met the
    # others there) has told everyone already: a closing handshake now would wait for nobody.
    told = collectives.disagreements != disagreements
    if not told:
        _agree(collectives, extended.synced, written, error)
    if error is not None:
        raise error
    rank = collectives.rank
    return nest.tree_map(lambda leaf: select(leaf, rank), result)


def _own(leaf: Any) -> Any:
    """This rank's argument as tf's regroup gives it on one replica: arrays become ``PerReplica``."""
    return PerReplica((leaf,)) if _is_data(leaf) else leaf


def select(leaf: Any, rank: int) -> Any:
    """This replica's component of a result, as tf's select_replica gives it."""
    if isinstance(leaf, PerReplica):
        return leaf.values[rank] if len(leaf.values) > 1 else leaf.values[0]
    if isinstance(leaf, Mirrored):
        return leaf.values[0]
    return leaf


def _agree(
    collectives: Collectives,
    synced: Callable[[int], Any],
    written: list[tuple[int, Any]],
    error: BaseException | None,
) -> None:
    """One handshake after merge_fn: it failed on no rank (else every rank raises), and, under
    ``MPISTRAT_CHECK=strict``, every mirrored variable it wrote (``synced`` finds it by key) holds
    the same bytes everywhere."""
    fingerprint, describe = 0, None
    if check_level(collectives) > 1:
        mirrored = [(synced(k), v) for k, v in dict(written).items()]
        sums = [(repr(var.name), checksum(v)) for var, v in mirrored if getattr(var, "mirrored", False)]
        fingerprint = code_of(*sums) if sums else 0  # sync-on-read copies differ by design
        describe = lambda: {  # noqa: E731
            "leaves": [(f"variable {name}", f"checksum {c:016x}", None) for name, c in sums],
            "advice": _DIVERGED,
        }
    try:
        collectives.agree("merge_call", fingerprint=fingerprint, describe=describe, error=error)
    except BaseException:
        if error is not None:
            raise error from None  # this rank's own exception, with its traceback
        raise


_DIVERGED = (
    "The copies of a mirrored variable differ between ranks after merge_fn updated them "
    "(MPISTRAT_CHECK=strict compares their checksums). Every rank must apply the same update to the "
    "same reduced values: look for randomness, rank-dependent values or non-deterministic arithmetic "
    "in the update."
)
