"""One optimizer step over a group's packs: stage the gradients, reduce, update, gather.

Per pack: the gradients are copied into the staging buffer and summed over the ranks in
place (reduce-scattered when sharded), this rank's elements are updated, and (sharded) the
pack's parameters are all-gathered. :func:`run` does that pack after pack.

A reduction that can fail once its data has moved must fail before anything is written, or a
step that raises would leave the packs before the failing one updated (and a retry would
update them twice). 16-bit compression is such a reduction: an overflow is found only when a
block is summed. :func:`run_reduced_first` then reduces every pack of every group first,
keeping each result (the gradients' size unsharded, this rank's 1/R sharded), and updates
only once all have arrived. So does every step where a rank's death can be survived: each
rank then applies a step whole or not at all (``distribute/recovery.py``).

An optimizer's :class:`Rule` adds what Keras's base arguments do around the update (loss
scaling, clipping, weight decay, EMA, LAMB's trust ratios). A rule that needs a norm over whole
variables (``whole``) runs :func:`run_whole`: every pack reduced and kept, then ``before`` over
all of them (its per-variable partial norms summed over the ranks in one all-reduce when
sharded), the updates, ``after``, and the gathers; ``before`` may skip the step on every rank
alike (a loss-scaled step whose gradient is not finite). A rule may read each block right after
its update, while it is in cache (``each_block``: LAMB sums its norms there). Otherwise
``before`` and ``after`` run pack by pack in :func:`run`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives
    from mpistrat.options import CommunicationOptions
    from mpistrat.training.groups import Group

__all__ = [
    "BLOCK",
    "WHOLE",
    "GroupStep",
    "Pack",
    "Piece",
    "Read",
    "Rule",
    "Run",
    "Update",
    "Updates",
    "gather_pack",
    "joined",
    "owned_ranges",
    "owned_segments",
    "reduce_all",
    "run",
    "run_reduced_first",
    "run_whole",
    "update_pack",
    "update_reduced",
]

# A range of more than WHOLE elements is updated BLOCK elements at a time, so that each block's
# parameters, gradients and slots stay in cache across the update's passes. Measured
# (docs/performance.md): at 16M float32 parameters Adam's update takes 0.6x the time in 256K
# blocks; at 1M, whole passes are as fast or faster. A rule that reads each block right after its
# update (LAMB's norms) takes BLOCK at a time whatever the range's size: it reads it from cache.
BLOCK = 1 << 18
WHOLE = 1 << 20

# update(w, g, slots, lr, step): one step on matching 1-D blocks, in place; g is theirs to overwrite.
Update = Callable[[Any, Any, list[Any], float, int], None]
# read(start, stop): what follows the update of parameters start:stop while they are in cache.
Read = Callable[[int, int], None]


class Piece(NamedTuple):
    """Elements ``start:stop`` of the step's gradient ``grad`` (flattened)."""

    grad: int
    start: int
    stop: int


class Run(NamedTuple):
    """Pieces that fill ``staging[lo:hi]`` end to end; ``whole`` when each is a whole gradient."""

    lo: int
    hi: int
    pieces: list[Piece]
    whole: bool


class Updates(Protocol):
    """Which elements of one group a step updates (what an update and a :class:`Rule` read)."""

    group: Group  # its layout, flat parameters, slots and staging
    present: list[int]  # the group's variables given gradients in this step, in group order
    updates: list[list[tuple[int, int]]]  # per pack: element ranges this rank updates
    # per pack: (start, stop, p) for each variable this rank updates, p its index in ``present``
    segments: list[list[tuple[int, int, int]]]


class GroupStep(Updates, Protocol):
    """What a step does with one group of variables (``optimizer_state``'s plan of it), as read here."""

    runs: list[list[Run]]  # per pack: where the gradients go in the staging buffer
    gaps: list[list[tuple[int, int]]]  # per pack: staging ranges no gradient fills


# (the group's step, its gradients, its claimed parameter array)
Work = tuple[GroupStep, list[Any], Any]


class Pack(NamedTuple):
    """One reduced pack, ``k`` of a group's step."""

    step: Updates
    k: int
    grad: Any  # the summed gradient of this rank's elements
    base: int  # the parameter index of its first element
    params: Any  # the group's claimed parameters
    slots: list[Any]  # its claimed slots


class Rule(Protocol):
    """What an optimizer does around its per-block update in one step (Keras's base arguments)."""

    whole: bool  # every pack reduced before the first is updated: norms over whole variables
    code: int  # the arguments' code in the step's handshake (ranks that differ raise)
    described: str  # the arguments, as a mismatch names them

    def update(self, w: Any, g: Any, slots: list[Any], lr: float, step: int) -> None: ...

    def before(self, packs: list[Pack]) -> bool:
        """Gradient transforms and weight decay; False skips the step (the same on every rank)."""
        ...

    def each_block(self, pack: Pack) -> Read | None:
        """What reads each block of ``pack`` right after its update (LAMB's norms), or None."""
        ...

    def after(self, packs: list[Pack]) -> None: ...

    def replay(self, packs: list[Pack]) -> None:
        """The same step on other elements, with what ``before`` and ``after`` found (no communication)."""
        ...


def run(
    collectives: Collectives | None,
    work: list[Work],
    update: Update,
    lr: float,
    step: int,
    kind: str,
    options: CommunicationOptions | None,
    rows: int = 0,
    rule: Rule | None = None,
) -> None:
    """Each group's packs in turn: reduce, update, gather.

    ``rows`` > 0: each gradient is ``[rows, *shape]``, an accumulation cycle's gradients, and a
    pack's reduction is their exact mean over the rows and ranks (``deterministic=True``).
    ``rule``: its ``before`` and ``after`` around each pack's update (``rule.whole`` is false)."""
    for s, grads, params in work:
        slots = s.group.claim_slots()
        for k in range(s.group.layout.packs):
            grad, base = _reduced(collectives, s, grads, k, kind, options, rows)
            if rule is not None:
                rule.before([Pack(s, k, grad, base, params, slots)])
            update_pack(s, k, grad, base, params, slots, update, lr, step)
            if rule is not None:
                rule.after([Pack(s, k, grad, base, params, slots)])
            gather_pack(collectives, s, k, params, kind, options)


def run_whole(
    collectives: Collectives | None,
    work: list[Work],
    rule: Rule,
    lr: float,
    step: int,
    kind: str,
    options: CommunicationOptions | None,
    rows: int = 0,
) -> bool:
    """Every pack reduced and kept, then :func:`update_reduced`; False when the rule skipped the step."""
    packs = reduce_all(collectives, work, kind, options, rows)
    return update_reduced(collectives, packs, rule, lr, step, kind, options)


def update_reduced(
    collectives: Collectives | None,
    packs: list[Pack],
    rule: Rule,
    lr: float,
    step: int,
    kind: str,
    options: CommunicationOptions | None,
) -> bool:
    """The rule's ``before`` over every reduced pack, each pack's update, ``after``, then the
    gathers; nothing is written when ``before`` skips the step (on every rank alike)."""
    if not rule.before(packs):
        return False
    for pack in packs:
        update_pack(*pack, rule.update, lr, step, rule.each_block(pack))
    rule.after(packs)
    for s, k, _, _, params, _ in packs:
        gather_pack(collectives, s, k, params, kind, options)
    return True


def run_reduced_first(
    collectives: Collectives | None,
    work: list[Work],
    update: Update,
    lr: float,
    step: int,
    kind: str,
    options: CommunicationOptions | None,
    rows: int = 0,
) -> None:
    """Every pack of every group reduced (and kept) before the first is updated."""
    for s, k, grad, base, params, slots in reduce_all(collectives, work, kind, options, rows):
        update_pack(s, k, grad, base, params, slots, update, lr, step)
        gather_pack(collectives, s, k, params, kind, options)


def reduce_all(
    collectives: Collectives | None,
    work: list[Work],
    kind: str,
    options: CommunicationOptions | None,
    rows: int = 0,
) -> list[Pack]:
    """Every pack of every group reduced and kept: a group of one pack keeps its sum in its staging
    buffer, one of several (whose staging the next pack reuses) a copy of each pack's."""
    packs: list[Pack] = []
    for s, grads, params in work:
        slots = s.group.claim_slots()
        several = s.group.layout.packs > 1
        for k in range(s.group.layout.packs):
            grad, base = _reduced(collectives, s, grads, k, kind, options, rows)
            packs.append(Pack(s, k, grad.copy() if several else grad, base, params, slots))
    return packs


def _reduced(
    collectives: Collectives | None,
    s: GroupStep,
    grads: list[Any],
    k: int,
    kind: str,
    options: CommunicationOptions | None,
    rows: int,
) -> tuple[Any, int]:
    if rows:
        return _reduce_rows(collectives, s, grads, k, kind, rows)
    return _reduce(collectives, s, grads, k, kind, options)


def _reduce(
    collectives: Collectives | None,
    s: GroupStep,
    grads: list[Any],
    k: int,
    kind: str,
    options: CommunicationOptions | None,
) -> tuple[Any, int]:
    """Pack ``k``'s summed gradients (a view of the staging buffer) and the parameter index of its
    first element: this rank's block when sharded, the whole pack otherwise."""
    group, lay = s.group, s.group.layout
    xp, staging = group.xp, group.staging
    lo, hi = lay.bounds(k)
    for run in s.runs[k]:
        if run.whole:  # one C call, whatever the gradients' shapes
            xp.concatenate([grads[p.grad] for p in run.pieces], axis=None, out=staging[run.lo : run.hi])
        else:
            pieces = [grads[p.grad].reshape(-1)[p.start : p.stop] for p in run.pieces]
            xp.concatenate(pieces, out=staging[run.lo : run.hi])
    for a, b in s.gaps[k]:
        staging[a:b] = 0
    if lay.sharded:
        assert collectives is not None
        collectives.reduce_scatter_in_place(staging, kind=kind, options=options)
        return staging[: lay.per_rank], lay.owned(k)[0]
    if collectives is not None:
        collectives.all_reduce_in_place(staging[: hi - lo], kind=kind, options=options)
    return staging[: hi - lo], lo


def _reduce_rows(
    collectives: Collectives | None, s: GroupStep, grads: list[Any], k: int, kind: str, rows: int
) -> tuple[Any, int]:
    """As :func:`_reduce`, for ``[rows, *shape]`` gradients summed exactly and divided by ``rows``."""
    group, lay = s.group, s.group.layout
    xp, staging = group.xp, group.staging
    stack = group.row_staging(rows)
    lo, hi = lay.bounds(k)
    for run in s.runs[k]:
        pieces = [grads[p.grad].reshape(rows, -1)[:, p.start : p.stop] for p in run.pieces]
        xp.concatenate(pieces, axis=1, out=stack[:, run.lo : run.hi])
    for a, b in s.gaps[k]:
        stack[:, a:b] = 0
    n = lay.pack if lay.sharded else hi - lo
    assert collectives is not None
    collectives.exact_mean_in_place(stack[:, :n], staging[:n], kind=kind)
    if lay.sharded:  # the whole pack's mean, as a deterministic reduce-scatter has it: keep this block
        start = lay.rank * lay.per_rank
        staging[: lay.per_rank] = staging[start : start + lay.per_rank].copy()
        return staging[: lay.per_rank], lay.owned(k)[0]
    return staging[:n], lo


def update_pack(
    s: Updates,
    k: int,
    grad: Any,
    base: int,
    params: Any,
    slots: list[Any],
    update: Update,
    lr: float,
    step: int,
    read: Read | None = None,
) -> None:
    """This rank's elements of pack ``k`` updated from ``grad``, whose element 0 is parameter ``base``;
    ``read(start, stop)`` after each block's update (blocks of at most ``BLOCK`` elements then)."""
    shift = s.group.layout.slot_start(k) - base  # a slot's index minus its parameter's
    for a, b in s.updates[k]:
        block = b - a if b - a <= WHOLE and read is None else BLOCK
        for start in range(a, b, block):
            stop = min(start + block, b)
            update(
                params[start:stop],
                grad[start - base : stop - base],
                [slot[start + shift : stop + shift] for slot in slots],
                lr,
                step,
            )
            if read is not None:
                read(start, stop)


def gather_pack(
    collectives: Collectives | None,
    s: Updates,
    k: int,
    params: Any,
    kind: str,
    options: CommunicationOptions | None = None,
) -> None:
    """Sharded: pack ``k``'s parameters from the ranks that updated them to every rank."""
    if s.group.layout.sharded:
        assert collectives is not None
        lo, hi = s.group.layout.bounds(k)
        collectives.all_gather_in_place(params[lo:hi], kind=kind, options=options)


def owned_segments(
    group: Group, present: list[int], k: int, rank: int | None = None
) -> list[tuple[int, int, int]]:
    """``(start, stop, p)`` for each of the ``present`` variables of ``group`` (``p`` its index in
    ``present``) with elements in pack ``k`` that
    ``rank`` (this rank) updates."""
    spans = group.params.spans
    own_lo, own_hi = group.layout.owned(k, rank)
    out = []
    for p, i in enumerate(present):
        a, b = max(spans[i][0], own_lo), min(spans[i][1], own_hi)
        if a < b:
            out.append((a, b, p))
    return out


def owned_ranges(group: Group, present: list[int], k: int, rank: int | None = None) -> list[tuple[int, int]]:
    """:func:`owned_segments` as element ranges, adjacent ones joined."""
    return joined([(a, b) for a, b, _ in owned_segments(group, present, k, rank)])


def joined(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent ranges joined.

    >>> joined([(0, 2), (2, 5), (7, 9)])
    [(0, 5), (7, 9)]
    """
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
