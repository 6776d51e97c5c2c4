"""An optimizer's flat state: its variables and slots in flat buffers, and the step over them.

``build`` puts the variables it is given, per dtype, into a ``groups.Group``: their values
in one :class:`~mpistrat.training.flat_storage.FlatBuffer` (in creation order, the same on every
rank), each slot in another (sharded: only this rank's part of it), a staging buffer for
one pack of gradients.

A group's elements are cut into packs (:class:`~mpistrat.training.layout.Layout`: sharded, each
rank owns one block of every pack).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat.collectives import failure
from mpistrat.collectives.fingerprint import code_of
from mpistrat.collectives.handshake import check_level
from mpistrat.collectives.sum_modes import PLAIN, SumMode, sum_mode
from mpistrat.comm import packing
from mpistrat.diagnostics import ulfm
from mpistrat.errors import InvalidArgumentError, MpistratError
from mpistrat.training import pack_step, shard_copies
from mpistrat.training.flat_storage import FlatBuffer
from mpistrat.training.groups import Group
from mpistrat.training.layout import Layout
from mpistrat.training.optimizer_checks import compare_copies
from mpistrat.training.pack_step import BLOCK, WHOLE, Piece, Run, Update
from mpistrat.training.recovery import broadcast_in_place
from mpistrat.values import local_variable

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives
    from mpistrat.options import CommunicationOptions
    from mpistrat.training.variables import Variable

__all__ = [
    "BLOCK",
    "SAME_VARIABLES",
    "WHOLE",
    "FlatState",
    "checked_gradients",
    "creation_order",
    "rate_code",
    "storage_place",
]


@dataclasses.dataclass
class _GroupStep:
    """What one step does with one group, for one set of variables given gradients."""

    group: Group
    positions: list[int]  # index in the step's pairs of each present variable, in group order
    present: list[int]  # the group indices of those variables
    runs: list[list[Run]]  # per pack: where the gradients go in the staging buffer
    gaps: list[list[tuple[int, int]]]  # per pack: staging ranges no gradient fills (zeros)
    updates: list[list[tuple[int, int]]]  # per pack: element ranges this rank updates
    segments: list[list[tuple[int, int, int]]]  # per pack: (start, stop, p) of each present variable p


def _plan_group(group: Group, positions: list[int], present: list[int]) -> _GroupStep:
    lay, spans = group.layout, group.params.spans
    sizes = [spans[i][1] - spans[i][0] for i in present]
    runs, gaps, updates, segments = [], [], [], []
    for k in range(lay.packs):
        lo, hi = lay.bounds(k)
        pieces: list[tuple[int, int, int, int]] = []  # (staging start, j, start, stop in var j)
        for j, i in enumerate(present):
            a, b = spans[i]
            if a < hi and b > lo:
                pieces.append((max(a, lo) - lo, j, max(a, lo) - a, min(b, hi) - a))
        pack_runs: list[Run] = []
        for start, j, a, b in pieces:
            if pack_runs and pack_runs[-1].hi == start:
                last = pack_runs[-1]
                pack_runs[-1] = Run(last.lo, start + b - a, [*last.pieces, Piece(j, a, b)], False)
            else:
                pack_runs.append(Run(start, start + b - a, [Piece(j, a, b)], False))
        edges = [0] + [e for r in pack_runs for e in (r.lo, r.hi)] + [hi - lo]
        gaps.append([(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if a < b])
        whole = [all(p.start == 0 and p.stop == sizes[p.grad] for p in r.pieces) for r in pack_runs]
        runs.append([Run(r.lo, r.hi, r.pieces, w) for r, w in zip(pack_runs, whole, strict=True)])
        each = pack_step.owned_segments(group, present, k)
        updates.append(pack_step.joined([(a, b) for a, b, _ in each]))
        segments.append(each)
    return _GroupStep(group, positions, present, runs, gaps, updates, segments)


@dataclasses.dataclass
class _Plan:
    steps: list[_GroupStep]
    fingerprint: int
    described: list[tuple[str, str, Any]]
    variables: list[Variable]  # keeps the variables (and so the ids the plan is cached by) alive
    like: tuple[list[Any], list[Any], list[Any]]  # the variables' array types, shapes and dtypes

    def matches(self, grads: list[Any]) -> bool:
        """Whether ``grads`` are arrays of their variables' types, shapes and dtypes (no Python per
        gradient: the common case, checked in C)."""
        types, shapes, dtypes = self.like
        return (
            list(map(type, grads)) == types
            and list(map(_SHAPE, grads)) == shapes
            and list(map(_DTYPE, grads)) == dtypes
        )

    def written(self) -> list[tuple[str, Any]]:
        """``(name, this rank's array)`` of every variable a step of this plan writes."""
        return [(s.group.variables[j].name, s.group.params.views[j]) for s in self.steps for j in s.present]


_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")


class FlatState:
    """The flat groups of one optimizer and the fused step over them.

    Args:
        slot_names: the optimizer's slots.
        shard: shard the slots over the ranks (ZeRO stage 1).
    """

    def __init__(self, slot_names: tuple[str, ...], shard: bool):
        self.slot_names = slot_names
        self.shard = shard
        self.groups: list[Group] = []
        self.where: dict[int, tuple[Group, int]] = {}  # id(variable) -> its group and index there
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self.steps = 0  # applied on this rank (a recovery after a rank's death goes on from the most)
        self.copies: shard_copies.Copies | None = None  # of sharded state, where a death is survivable

    def add(
        self,
        variables: list[Variable],
        slot_variables: dict[str, list[Variable]] | None,
        *,
        ranks: int,
        rank: int,
        bytes_per_pack: int,
    ) -> None:
        """Put new ``variables`` (in the same order on every rank) into groups, one per dtype."""
        by_kind: dict[tuple[Any, Any], list[int]] = {}
        for i, var in enumerate(variables):
            local = local_variable(var).local_array
            by_kind.setdefault((packing.array_module(local), local.dtype), []).append(i)
        for (_, dtype), indices in by_kind.items():
            size = sum(int(np.prod(variables[i].shape)) for i in indices)
            layout = Layout.make(size, dtype.itemsize, bytes_per_pack, ranks if self.shard else 1, rank)
            slots = (
                None
                if slot_variables is None
                else {n: [s[i] for i in indices] for n, s in slot_variables.items()}
            )
            group = Group([variables[i] for i in indices], slots, self.slot_names, layout)
            self.groups.append(group)
            for j, i in enumerate(indices):
                self.where[id(variables[i])] = (group, j)
        self._plans.clear()

    def recovery_facts(self) -> Any:
        """What a recovery needs of this state here (sharded: ``shard_copies.Facts``)."""
        return shard_copies.facts(self)

    def recover(self, recovery: Any, facts: list[Any]) -> None:
        """After a rank's death (collective over the survivors): unsharded groups take their weights
        and slots from ``recovery.source``; sharded ones are laid out over the survivors from every
        part's holder (``shard_copies.recover``)."""
        comm, source = recovery.collectives.comm, recovery.source
        for group in self.groups:
            if not group.layout.sharded:
                broadcast_in_place(comm, group.params.claim(), source)
                for slot in group.slots.values():
                    broadcast_in_place(comm, slot.claim(), source)
        if facts[0] is not None:
            shard_copies.recover(self, recovery, facts)
        self._plans.clear()

    def cached_plan(self, variables: list[Variable]) -> _Plan | None:
        """The plan of a step over ``variables`` in this order, if one was made (so they are built)."""
        return self._plans.get(tuple(map(id, variables)))

    def nbytes(self) -> int:
        """Bytes of optimizer state this rank holds (slots, staging), parameters aside."""
        return sum(g.nbytes for g in self.groups)

    # -- the step -----------------------------------------------------------------------------

    def plan(self, variables: list[Variable]) -> _Plan:
        key = tuple(map(id, variables))
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        chosen: dict[int, list[tuple[int, int]]] = {}  # id(group) -> [(index in group, position)]
        for position, var in enumerate(variables):
            group, j = self.where[id(var)]
            chosen.setdefault(id(group), []).append((j, position))
        steps = []
        for group in self.groups:
            if id(group) in chosen:
                picked = sorted(chosen[id(group)])
                if len({j for j, _ in picked}) != len(picked):
                    name = group.variables[picked[0][0]].name
                    raise InvalidArgumentError(
                        f"apply_gradients: a variable is given more than one gradient (e.g. {name!r}); "
                        "sum its gradients first"
                    )
                steps.append(_plan_group(group, [p for _, p in picked], [j for j, _ in picked]))
        described = [
            (
                repr(s.group.variables[j].name),
                f"gradient for variable #{creation_order(s.group.variables[j])}",
                (),
            )
            for s in steps
            for j in s.present
        ]
        fingerprint = code_of(
            "apply_gradients",
            self.shard,
            tuple(
                (creation_order(s.group.variables[j]), s.group.variables[j].shape)
                for s in steps
                for j in s.present
            ),
        )
        if len(self._plans) >= 64:  # a loop repeats a few sets; anything else is not worth keeping
            self._plans.clear()
        locals_ = [local_variable(v).local_array for v in variables]
        like = ([type(a) for a in locals_], [a.shape for a in locals_], [a.dtype for a in locals_])
        plan = self._plans[key] = _Plan(steps, fingerprint, described, list(variables), like)
        return plan

    def step(
        self,
        collectives: Collectives | None,
        grads: list[Any],
        variables: list[Variable],
        update: Update,
        lr: float,
        step: int,
        *,
        plan: _Plan | None = None,
        kind: str = "apply_gradients",
        options: CommunicationOptions | None = None,
        pending: MpistratError | None = None,
        rows: int = 0,
        rule: pack_step.Rule | None = None,
    ) -> bool:
        """One step: check, one handshake, then per group and pack: reduce, update, (gather).

        ``plan``: :meth:`cached_plan` of ``variables``, if the caller has it. ``options``: the
        optimizer's ``CommunicationOptions`` for the gradients' reduction (deterministic,
        compression), over the strategy's.

        ``collectives`` is None for the single-replica default strategy (nothing to send).
        Bad input found on any rank (a gradient's shape, a variable's new shape, a different
        set of variables) raises on every rank before anything is sent or written, as does
        ``pending``, an error this rank found earlier (on a call that only accumulated).
        ``rows`` > 0: each gradient is ``[rows, *shape]`` (checked as it was kept), reduced to
        the exact mean over its rows and the ranks. ``rule``: what the optimizer's base arguments
        add around ``update`` (:class:`~mpistrat.training.pack_step.Rule`). Returns False when the
        rule skipped the step (on every rank alike), True when it was applied.
        """
        error: MpistratError | None = pending
        try:
            plan = plan or self.plan(variables)
            if not rows and not plan.matches(grads):
                grads = checked_gradients(grads, variables)
            params = [s.group.params.claim() for s in plan.steps]
        except MpistratError as exc:
            error = error or exc
        mode: SumMode = PLAIN
        if collectives is not None:
            described = plan.described if plan is not None else []
            mode = collectives.sum_mode if options is None else sum_mode(collectives.options.merge(options))
            described = [
                ("gradient reduction", mode.name or "plain MPI sum", None),
                ("learning_rate", repr(lr), None),
                ("base arguments", "none" if rule is None else rule.described, None),
                *described,
            ]  # named if it differs
            collectives.agree(
                kind,
                fingerprint=(0 if plan is None else plan.fingerprint)
                ^ mode.code
                ^ rate_code(lr)
                ^ _code_of(rule),
                describe=lambda: {"leaves": described, "advice": SAME_VARIABLES},
                error=error,  # always sent: it checks the step's unchecked collectives before any write
                options=options,  # the optimizer's check and timeout
            )
        elif error is not None:
            raise error
        assert plan is not None
        work: list[pack_step.Work] = [
            (s, [grads[p] for p in s.positions], w) for s, w in zip(plan.steps, params, strict=True)
        ]
        # An overflow found once data has moved must raise before the first pack is written; where a
        # rank's death can be survived, every step is all-or-nothing on each rank (distribute/recovery.py).
        live = collectives is not None and ulfm.live()
        whole = live or _fails_late(mode, plan)
        applied = True
        try:
            if live and self.shard and collectives is not None and collectives.size > 1:
                # each rank's part of the slots is also kept by another rank (training/shard_copies.py)
                applied = shard_copies.run(
                    self, collectives, work, update, lr, step, kind, options, rows, rule
                )
            elif rule is not None and (rule.whole or whole):
                applied = pack_step.run_whole(collectives, work, rule, lr, step, kind, options, rows)
            elif whole:
                pack_step.run_reduced_first(collectives, work, update, lr, step, kind, options, rows)
            else:
                pack_step.run(collectives, work, update, lr, step, kind, options, rows, rule)
        except BaseException:  # an update raising on one rank leaves the others in a transfer
            failure.abandon(collectives)
            raise
        self.steps += 1
        if collectives is not None:
            collectives.commits += 1  # done here, applied or skipped: what a recovery goes on from
            if check_level(collectives, options) > 1:
                compare_copies(collectives, plan.written(), kind, options)
        return applied


@functools.lru_cache(maxsize=8)  # a rate set by hand repeats; a schedule's changes each step
def rate_code(lr: float) -> int:
    """The code of a step's learning rate in its handshake: ranks that set different rates raise."""
    return code_of("learning_rate", lr)


def _code_of(rule: pack_step.Rule | None) -> int:
    """What a step's rule adds to its handshake: ranks whose base arguments differ raise."""
    return 0 if rule is None else rule.code


def _fails_late(mode: SumMode, plan: _Plan) -> bool:
    """Whether a pack's reduction may raise after others were reduced (16-bit compression's
    overflow) in a step of more than one pack."""
    return mode.fails_late and sum(s.group.layout.packs for s in plan.steps) > 1


SAME_VARIABLES = (
    "Every rank must give gradients for the same variables (in any order), with the variables' shapes. "
    "A gradient that is None on one rank only, or a variable that exists on one rank only, leaves the "
    "copies different: give every rank's gradient (zeros where a rank has none)."
)


def storage_place(var: Variable) -> tuple[FlatBuffer, int, int] | None:
    """Where ``var``'s copy lies in an optimizer's flat storage: the storage, its first variable's
    :func:`creation_order` (the same on every rank) and the element it starts at; None outside
    flat storage. A checkpoint lays values out in this order, so that a rank's share of them is
    one run of memory, and restores adjacent ones straight into it."""
    local = local_variable(var)
    storage = local.storage
    if not isinstance(storage, FlatBuffer):  # None: not in flat storage
        return None
    first = storage.members[0]
    owner = first if first.owner is None else first.owner  # the distributed variable it belongs to
    return storage, creation_order(owner), storage.start_of(local)


def creation_order(var: Any) -> int:
    """A distributed variable's number in its strategy, the same on every rank (plain ones: 0)."""
    return int(getattr(var, "synced_key", 0))


def checked_gradients(grads: list[Any], variables: list[Variable]) -> list[Any]:
    """Each gradient as an array, checked against its variable's shape, dtype and array module."""
    out = []
    for grad, var in zip(grads, variables, strict=True):
        local = local_variable(var)._value  # every variable at every step: the attribute, not local_array
        if type(grad) is not type(local):
            grad = packing.as_array(grad, f"apply_gradients: the gradient of {var.name!r}")
            if packing.array_module(grad) is not packing.array_module(local):
                raise InvalidArgumentError(
                    f"apply_gradients: the gradient of {var.name!r} is a {type(grad).__module__} array, its "
                    f"variable a {type(local).__module__} one; pass gradients where the variable lives"
                )
        if grad.shape != local.shape:
            raise InvalidArgumentError(
                f"apply_gradients: the gradient of {var.name!r} has shape {tuple(grad.shape)}; expected "
                f"the variable's shape {tuple(local.shape)} (gradients are not broadcast)"
            )
        if grad.dtype != local.dtype and not np.can_cast(grad.dtype, local.dtype, "same_kind"):
            raise InvalidArgumentError(
                f"apply_gradients: the gradient of {var.name!r} is {grad.dtype}; its variable is "
                f"{local.dtype}, which it cannot be cast to without losing information"
            )
        out.append(grad)
    return out
