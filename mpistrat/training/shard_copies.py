"""Keepers: a sharded optimizer's state survives the death of the rank that holds it.

With ``shard_state=True`` each rank's part of the slots exists nowhere else. Where a rank's death
can be survived (``ulfm.live()``: Open MPI with ``--with-ft ulfm``), every rank also keeps a
replica of one other rank's part, its partner's, and its own part is kept by its keeper, rank
``(r + n) mod R``, ``n`` the most ranks on one node (:func:`keeper_shift`): on another node when
nodes hold consecutive ranks, as ``srun`` and ``mpiexec`` place them. A step (:func:`run`):

1. reduce-scatters every pack, keeping this rank's blocks of the summed gradients;
2. sends them to the keeper and receives the partner's (one shard: ``1/R`` of the gradients, the
   step's only extra bytes), and takes the partner's part of the parameters from this rank's copy
   of them;
3. copies its own part (parameters and slots) aside, updates it (with what the optimizer's base
   arguments add around the update: ``base_arguments.StepRule``), all-gathers the parameters;
4. once every pack is in, replays the partner's update on the replica: the same arithmetic on
   the same values, so the same bits as the partner's own. A rule's norms over whole variables
   (clipping, LAMB's trust ratios) are summed over every rank, so the keeper replays with the
   values it found itself (``StepRule.replay``); a step the rule skipped (a loss scale's, not
   finite) is skipped by the partner too, and nothing is replayed.

A recovery (:func:`recover`) then finds every part at the step the survivors go on from (the most
steps any survivor applied): a live rank's own (or its copy aside, if it updated its part in a
step no survivor completed), a lost rank's on its keeper, at the replica's step or one later (its
gradients received). Each survivor contributes the parts it holds, every survivor assembles them
and keeps its part of the layout over the survivors, and the copies start again over the new
pairs. Only a rank lost together with its keeper loses state: every survivor then raises
``PeerFailedError``. A checkpoint's restore rewrites the slots: the copies are made again, whole,
at the next step.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat.comm import mpi, packing
from mpistrat.errors import PeerFailedError
from mpistrat.training import pack_step, placement
from mpistrat.training.flat_storage import FlatBuffer

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives
    from mpistrat.options import CommunicationOptions
    from mpistrat.training.groups import Group

__all__ = ["Copies", "Facts", "facts", "keeper_shift", "recover", "run"]


def keeper_shift(hosts: tuple[str, ...], size: int) -> int:
    """How many ranks on a rank's keeper is: the most ranks one node holds (1 on a single node).

    >>> keeper_shift(("a", "a", "b", "b"), 4), keeper_shift(("a", "a", "a"), 3), keeper_shift((), 3)
    (2, 1, 1)
    """
    per_node = collections.Counter(hosts)
    if len(per_node) < 2:
        return 1
    return max(per_node.values()) % size or 1


@dataclasses.dataclass
class Copy:
    """One group's copies on this rank: each a list of the parameters' part, then each slot's."""

    undo: list[Any]  # this rank's part before the step in progress updated it
    replica: list[Any]  # the partner's part, at ``Copies.version`` steps
    pending: Any  # the partner's block of the summed gradients of the step after that
    mirror: Mirror | None = None  # that step as the partner runs it (None: no step)


@dataclasses.dataclass
class Mirror:
    """A group's step as the partner runs it, in the coordinates of the keeper's replica (the
    partner's elements of each pack end to end, pack ``k`` from ``k * per_rank``): what
    ``pack_step.update_pack`` and ``StepRule.replay`` read of a group step."""

    group: Group
    present: list[int]
    updates: list[list[tuple[int, int]]]
    segments: list[list[tuple[int, int, int]]]

    @classmethod
    def of(cls, s: pack_step.GroupStep, partner: int) -> Mirror:
        lay = s.group.layout
        segments = []
        for k in range(lay.packs):
            shift = k * lay.per_rank - lay.owned(k, partner)[0]
            owned = pack_step.owned_segments(s.group, s.present, k, partner)
            segments.append([(a + shift, b + shift, p) for a, b, p in owned])
        updates = [pack_step.joined([(a, b) for a, b, _ in each]) for each in segments]
        return cls(s.group, s.present, updates, segments)


@dataclasses.dataclass
class Call:
    """What the partner's step did: its update, learning rate, step number and rule."""

    update: pack_step.Update
    lr: float
    step: int
    rule: pack_step.Rule | None = None


class Copies:
    """A sharded flat state's copies on this rank (see the module docstring)."""

    def __init__(self, groups: list[Any], rank: int, size: int, shift: int):
        self.rank, self.size = rank, size
        self.keeper, self.partner = (rank + shift) % size, (rank - shift) % size
        self.groups: dict[int, Copy] = {}
        for g in groups:
            n, xp = g.layout.slot_length, g.xp
            parts = 1 + len(g.slots)
            self.groups[id(g)] = Copy(
                [placement.zeros(n, g.dtype, xp) for _ in range(parts)],
                [placement.zeros(n, g.dtype, xp) for _ in range(parts)],
                placement.zeros(n, g.dtype, xp),
            )
        self.version = -1  # steps the replica holds (-1: none yet: made whole at the next step)
        self.pending_step = -1  # the step whose gradients from the partner all arrived (-1: none)
        self.call: Call | None = None  # that step (None: nothing to replay)
        self.dirty = False  # this rank's part was updated in a step not yet applied whole
        self.skipped = False  # the last step counted wrote nothing (its rule skipped it)

    @property
    def stale(self) -> bool:
        return self.version < 0


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a recovery needs of a sharded flat state on one survivor."""

    steps: int  # steps applied
    dirty: bool  # its part was updated in a step not applied whole
    rank: int  # in the layout being replaced
    size: int  # that layout's ranks
    shift: int  # keeper_shift of the copies (0: none made yet)
    version: int  # steps of its replica (-1: none)
    pending: int  # the partner's step whose gradients it has (-1: none)
    skipped: bool = False  # its last step counted (``steps``) wrote nothing anywhere


def part(layout: Any, array: Any, rank: int) -> Any:
    """``rank``'s part of a group's flat ``array``: its elements of every pack, end to end (a view
    where one pack; a copy otherwise)."""
    if layout.packs == 1:
        lo, hi = layout.owned(0, rank)
        return array[lo:hi]
    return packing.array_module(array).concatenate(
        [array[slice(*layout.owned(k, rank))] for k in range(layout.packs)]
    )


def refresh(state: Any, collectives: Collectives) -> Copies:
    """New copies, made whole: the partner's slots sent over, its parameters taken here (collective)."""
    groups = [g for g in state.groups if g.layout.sharded]
    copies = Copies(
        groups, collectives.rank, collectives.size, keeper_shift(collectives.hosts, collectives.size)
    )
    for g in groups:
        c = copies.groups[id(g)]
        c.replica[0][...] = part(g.layout, g.params.array, copies.partner)
        for i, slot in enumerate(g.slots.values()):
            collectives.exchange(slot, copies.keeper, c.replica[1 + i], copies.partner, kind="shard copies")
    copies.version = state.steps
    for g in groups:
        g.rewritten = False
    return copies


def run(
    state: Any,
    collectives: Collectives,
    work: list[pack_step.Work],
    update: pack_step.Update,
    lr: float,
    step: int,
    kind: str,
    options: CommunicationOptions | None,
    rows: int = 0,
    rule: pack_step.Rule | None = None,
) -> bool:
    """One sharded step that keeps the copies (see the module docstring); False where ``rule``
    skipped it (on every rank alike). The state's ``steps`` are counted by the caller, after it."""
    copies = state.copies
    if (
        copies is None
        or copies.stale
        or copies.size != collectives.size
        or any(g.rewritten for g in state.groups)
    ):
        copies = state.copies = refresh(state, collectives)
    packs = pack_step.reduce_all(collectives, work, kind, options, rows)
    for s, _, _ in work:
        c = copies.groups[id(s.group)]
        blocks = [g for t, _, g, _, _, _ in packs if t is s]
        mine = blocks[0] if len(blocks) == 1 else s.group.xp.concatenate(blocks)
        collectives.exchange(mine, copies.keeper, c.pending, copies.partner, kind=kind)
        c.mirror = Mirror.of(s, copies.partner)
    copies.pending_step, copies.call = state.steps + 1, Call(update, lr, step, rule)
    for g in state.groups:  # the partner's parameters now; this rank's part aside, to take back a step
        c = copies.groups[id(g)]  # that no survivor completes
        c.replica[0][...] = part(g.layout, g.params.array, copies.partner)
        c.undo[0][...] = part(g.layout, g.params.array, copies.rank)
        for i, slot in enumerate(g.slots.values()):
            c.undo[1 + i][...] = slot
    copies.dirty = True
    applied = True
    if rule is not None:
        applied = pack_step.update_reduced(collectives, packs, rule, lr, step, kind, options)
    else:
        for t, k, g, base, params, slots in packs:
            pack_step.update_pack(t, k, g, base, params, slots, update, lr, step)
        for t, k, _, _, params, _ in packs:
            pack_step.gather_pack(collectives, t, k, params, kind, options)
    if not applied:  # skipped everywhere: the replica is the partner's part already
        copies.call = None
    advance(copies, state.groups)
    copies.dirty, copies.skipped = False, not applied
    return applied


def advance(copies: Copies, groups: list[Any]) -> None:
    """The partner's pending step replayed on its replica (no communication)."""
    call, packs = copies.call, list[pack_step.Pack]()
    for g in groups:
        c = copies.groups.get(id(g))
        if c is None or c.mirror is None:
            continue
        n = g.layout.per_rank
        for k in range(g.layout.packs):
            packs.append(
                pack_step.Pack(
                    c.mirror, k, c.pending[k * n : (k + 1) * n], k * n, c.replica[0], c.replica[1:]
                )
            )
        c.mirror = None
    if call is not None and call.rule is not None:
        call.rule.replay(packs)
    elif call is not None:
        for s, k, g, base, params, slots in packs:
            pack_step.update_pack(s, k, g, base, params, slots, call.update, call.lr, call.step)
    copies.version, copies.pending_step, copies.call = copies.pending_step, -1, None


def facts(state: Any) -> Facts | None:
    """This rank's :class:`Facts` (None where nothing is sharded)."""
    sharded = [g for g in state.groups if g.layout.sharded]
    if not sharded:
        return None
    lay, copies = sharded[0].layout, state.copies
    if copies is None:
        return Facts(state.steps, False, lay.rank, lay.ranks, 0, -1, -1)
    shift = (copies.keeper - copies.rank) % copies.size
    version = -1 if any(g.rewritten for g in sharded) else copies.version  # a restore since: stale
    pending, skipped = copies.pending_step, copies.skipped
    return Facts(state.steps, copies.dirty, copies.rank, copies.size, shift, version, pending, skipped)


def recover(state: Any, recovery: Any, found: list[Facts]) -> None:
    """Every sharded group laid out over the survivors at the most steps any of them applied, and the
    copies made again over the new pairs (collective over the survivors; see the module docstring).
    Nothing is changed until every survivor has it all: a death meanwhile starts the recovery again."""
    collectives = recovery.collectives
    steps = max(f.steps for f in found)
    providers = _providers(found, steps)
    clean = [j for j, f in enumerate(found) if f.steps == steps and not f.dirty]
    copies = state.copies
    if copies is not None and any(how == "replay" and j == collectives.rank for j, how in providers.values()):
        advance(copies, state.groups)  # the lost partner's gradients of that step are here
    shift = keeper_shift(collectives.hosts, collectives.size)
    keeper, partner = (
        (collectives.rank + shift) % collectives.size,
        (collectives.rank - shift) % collectives.size,
    )
    laid = []
    for g in [g for g in state.groups if g.layout.sharded]:
        c = None if copies is None else copies.groups.get(id(g))
        full = [
            _from(collectives, g.params.array, clean[0])
            if a == 0 and clean
            else _assemble(collectives, g, a, providers, c)
            for a in range(1 + len(g.slots))
        ]  # a survivor that applied the step and wrote nothing since holds every parameter
        laid.append((g, g.layout.over(collectives.size, collectives.rank), full))
    made = []  # the new copies: the partner's parameters from the whole, its slots sent over
    for _, new, full in laid:
        mine = [_own(new, a) for a in full[1:]]
        replica = [_own(new, full[0], partner)]
        for slot in mine:
            replica.append(np.empty_like(slot))
            if collectives.size > 1:
                collectives.exchange(slot, keeper, replica[-1], partner, kind="recovery (shard copies)")
        made.append((mine, replica))
    collectives.comm.Agree(1)  # uniform even if a rank dies in it: all go on, or all start again
    state.copies = Copies([], collectives.rank, collectives.size, shift) if collectives.size > 1 else None
    for (g, new, full), (mine, replica) in zip(laid, made, strict=True):
        xp = g.xp
        buffer = FlatBuffer(g.params.members, new.length)
        buffer.array[: new.size] = xp.asarray(full[0][: new.size])
        g.layout, g.params = new, buffer
        g.slots = {name: xp.asarray(slot) for name, slot in zip(g.slots, mine, strict=True)}
        g.staging, g.stream = placement.empty(new.pack, g.dtype, xp), None
        if state.copies is not None:
            n = new.slot_length
            state.copies.groups[id(g)] = Copy(
                [placement.zeros(n, g.dtype, xp) for _ in replica],
                [xp.asarray(r) for r in replica],
                placement.zeros(n, g.dtype, xp),
            )
    state.steps = steps
    if state.copies is not None:
        state.copies.version = steps


def _providers(found: list[Facts], steps: int) -> dict[int, tuple[int, str]]:
    """For each rank of the replaced layout, the survivor (its new rank) holding that rank's part at
    ``steps`` steps, and as what: its ``own`` part, its copy aside (``undo``), the keeper's
    ``replica``, or the replica one step on (``replay``). ``PeerFailedError`` where a part is lost.
    A step that was skipped (by a loss scale: every survivor that counted it says so) wrote
    nothing: a part one step behind holds it already."""
    size, shift = found[0].size, found[0].shift
    skipped = any(f.steps == steps and f.skipped for f in found)
    alive = {f.rank: j for j, f in enumerate(found)}
    out: dict[int, tuple[int, str]] = {}
    for o in range(size):
        if o in alive:
            f = found[alive[o]]
            if f.steps == steps or (f.steps == steps - 1 and (f.dirty or skipped)):
                out[o] = (alive[o], "undo" if f.steps == steps and f.dirty else "own")
                continue
            _lost(f"rank {o} holds its part at step {f.steps}, not {steps}")
        if not shift:
            _lost(f"rank {o} was lost before its part was first copied")
        keeper = (o + shift) % size
        if keeper not in alive:
            _lost(f"rank {o} and its keeper, rank {keeper}, were lost together")
        f = found[alive[keeper]]
        if f.version == steps or (f.version == steps - 1 and skipped):
            out[o] = (alive[keeper], "replica")
        elif f.version == steps - 1 and f.pending == steps:
            out[o] = (alive[keeper], "replay")
        else:
            _lost(f"rank {o}'s keeper holds its part at step {f.version}, not {steps}")
    return out


def _lost(why: str) -> None:
    raise PeerFailedError(
        f"MPIStrategy.recover: a sharded optimizer's state is lost ({why}); restore the last checkpoint",
        recoverable=False,
    )


def _host(array: Any) -> np.ndarray:
    return array if type(array) is np.ndarray else array.get()


def _from(collectives: Collectives, array: Any, root: int) -> np.ndarray:
    """``root``'s ``array``, on every rank (host memory)."""
    out = _host(array).copy()
    mpi.bcast(collectives.comm, out, root)
    return out


def _assemble(
    collectives: Collectives, g: Any, a: int, providers: dict[int, tuple[int, str]], c: Copy | None
) -> np.ndarray:
    """Flat array ``a`` of group ``g`` (0: the parameters, then each slot) whole, in element order,
    from every old rank's part as its provider holds it (host memory)."""
    lay, n = g.layout, g.layout.slot_length
    me, size = collectives.rank, collectives.size
    slots = list(g.slots.values())
    mine = []
    for o, (j, how) in sorted(providers.items()):
        if j != me:
            continue
        if how == "own":
            mine.append(_host(part(lay, g.params.array, o) if a == 0 else slots[a - 1]))
        else:
            assert c is not None
            mine.append(_host((c.undo if how == "undo" else c.replica)[a]))
    counts = [n * sum(1 for j, _ in providers.values() if j == r) for r in range(size)]
    displs = [sum(counts[:r]) for r in range(size)]
    received = np.empty(sum(counts), g.dtype)
    send = np.concatenate(mine) if mine else np.empty(0, g.dtype)
    mpi.allgatherv(collectives.comm, send, received, counts, displs)
    order = [o for r in range(size) for o, (j, _) in sorted(providers.items()) if j == r]
    full = np.zeros(lay.length, g.dtype)
    for at, o in enumerate(order):
        block = received[at * n : (at + 1) * n]
        for k in range(lay.packs):
            lo, hi = lay.owned(k, o)
            full[lo:hi] = block[k * lay.per_rank : (k + 1) * lay.per_rank]
    return full


def _own(layout: Any, full: np.ndarray, rank: int | None = None) -> np.ndarray:
    """``rank``'s (this rank's) part, under ``layout``, of an array given whole in element order."""
    rank = layout.rank if rank is None else rank
    out = np.zeros(layout.slot_length, full.dtype)
    for k in range(layout.packs):
        lo, hi = layout.owned(k, rank)
        stop = min(hi, layout.size)
        at = layout.slot_start(k)
        if stop > lo:
            out[at : at + stop - lo] = full[lo:stop]
    return out
