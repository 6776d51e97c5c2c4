"""The step over a stream of pairs: each piece's sum starts as soon as its gradients exist.

``apply_gradients`` given a generator of ``(gradient, variable)`` pairs (as a hand-written
backward pass yields them, last layer first) copies each gradient into its place
in a staging buffer the size of its group as it arrives. A piece whose variables all have their
gradient starts its sum at once, non-blocking (``Iallreduce``; ``Ireduce_scatter_block``
sharded), and the sums in flight are tested each time the caller hands over the next pair.

The pieces: with ``bytes_per_pack`` set (the strategy's or the optimizer's), each pack is one
piece, and the sums are the list step's. Without it the list step sums one pack per dtype, which
would leave nothing to overlap: the generator step then cuts each pack into :data:`PIECES` pieces
of at least :data:`PIECE_BYTES`, so that the sum left after the last gradient is 1/PIECES of
the communication (docs/performance.md measures the choice). While sums are in flight and
gradients still to come, a thread enters MPI's progress engine (:mod:`~mpistrat.collectives.progress`):
an MPI library moves a non-blocking sum on only inside MPI calls, which a backward pass does not
make; the step stops it once the stream ends or raises. Sharded state keeps its packs: a
pack's reduce-scatter gives each rank its block, and a piece of every block would span the
whole group, waiting for its first gradient as the whole pack does; ``bytes_per_pack`` cuts a
sharded layout into packs that overlap.

Pieces start in one fixed order: the last piece of the last group first, down to the first of
the first group, each once those after it have started. Every rank so starts the same sums
in the same order, whatever order its pairs come in and even when its pairs are wrong: a
mismatch cannot hang, as long as the generator itself calls no collective between its yields
(one would meet another rank's sum wherever their pairs differ).
When the stream ends, the pieces not started yet are started (a variable
without a gradient contributes zeros), one handshake agrees that every rank gave gradients for
the same variables (a bad pair, or the stream raising, on any rank is an error on every rank,
before anything is written), and each pack is updated (and gathered, sharded) once its pieces'
sums complete, the later ones still in flight. A variable the optimizer has not built is an error
(on every rank): the first step, with a generator, is the list step, and builds.

Packs of one piece are the list step's (:mod:`~mpistrat.training.pack_step`), so the weights are
the same bits wherever the MPI library's non-blocking sum adds in the order of its blocking one
(MPICH; see :mod:`~mpistrat.collectives.nonblocking`); in several pieces the same sums are cut
differently, the same bits at 2 ranks and to rounding beyond. The staging holds every pack at
once: one more buffer the size of the parameters. Every rank passes a generator, or every rank a
list: a streamed step's first collective is a sum, a list step's a handshake.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat.collectives import failure, nonblocking, progress
from mpistrat.collectives.handshake import check_level
from mpistrat.collectives.sum_modes import PLAIN, sum_mode
from mpistrat.comm import mpi
from mpistrat.diagnostics import ulfm
from mpistrat.errors import InvalidArgumentError
from mpistrat.options import CommunicationImplementation
from mpistrat.training import pack_step, placement
from mpistrat.training.groups import Group, Staging
from mpistrat.training.layout import Layout
from mpistrat.training.optimizer_checks import compare_copies, own_replica_strategy
from mpistrat.training.optimizer_state import (
    SAME_VARIABLES,
    FlatState,
    checked_gradients,
    rate_code,
)
from mpistrat.training.variables import Variable, Writable
from mpistrat.values import local_variable

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives
    from mpistrat.interface.protocols import StrategyProtocol
    from mpistrat.options import CommunicationOptions

__all__ = ["PIECES", "PIECE_BYTES", "OptimizerView", "apply", "can_stream", "step"]

# Without bytes_per_pack, a pack's sum is started in this many pieces, each of at least PIECE_BYTES
# (a smaller group in fewer): the sum left after the last gradient is then 1/PIECES of them.
PIECES = 64
PIECE_BYTES = 1 << 18


@dataclasses.dataclass(frozen=True)
class OptimizerView:
    """What the streamed step needs of the optimizer whose ``apply_gradients`` it runs."""

    name: str
    strategy: StrategyProtocol | None  # the strategy it was made under
    state: FlatState | None  # its flat state, once built
    options: CommunicationOptions | None  # its communication options, over the strategy's
    accumulating: bool  # gradient_accumulation_steps > 1
    adopt: Callable[[Any], None]  # registers a variable it updates
    update: pack_step.Update  # its in-place update of flat blocks
    iterations: Variable
    rate_at: Callable[[int], tuple[float, BaseException | None]]  # a step's rate, or why it has none
    rule_at: Callable[[float, int], pack_step.Rule | None]  # what its base arguments add to a step


def apply(optimizer: OptimizerView, pairs: Iterable[tuple[Any, Any]]) -> list[Any] | bool:
    """``apply_gradients(pairs)`` for a generator: the streamed step where it can overlap (whether
    it was applied, once done), else the pairs as a list, for the list step.

    Not without a distributed strategy, before the first step has built the state, with
    gradient accumulation, or where :func:`can_stream` says no."""
    state = optimizer.state
    if optimizer.accumulating or optimizer.strategy is None or state is None:
        return list(pairs)
    strategy = own_replica_strategy(optimizer.name, optimizer.strategy, [])
    collectives = None if strategy is None else strategy.extended.collectives
    if collectives is None or not can_stream(state, collectives, optimizer.options):
        return list(pairs)

    def where(var: Any) -> tuple[Group, int]:
        if not isinstance(var, Variable):
            raise InvalidArgumentError(
                f"{optimizer.name}.apply_gradients: expected (gradient, Variable) pairs; got a "
                f"{type(var).__name__}"
            )
        optimizer.adopt(var)
        return state.where[id(var)]

    counter = local_variable(optimizer.iterations)
    now = int(counter.local_array)
    lr, bad_rate = optimizer.rate_at(now)
    rule = optimizer.rule_at(lr, now)
    update = optimizer.update if rule is None else rule.update
    applied = step(
        collectives, state, pairs, where, update, lr, now, name=optimizer.name, pending=bad_rate, rule=rule,
        options=optimizer.options,
    )  # fmt: skip
    if applied:
        with Writable(counter) as count:  # this rank's copy: every rank counts the same steps
            count += 1
    return applied


def can_stream(
    state: FlatState | None, collectives: Collectives | None, options: CommunicationOptions | None
) -> bool:
    """Whether a step can overlap: built flat host state, a plain MPI sum, packs MPI takes whole.

    Decided from what every rank holds alike (the built groups, the options), never from the pairs.
    """
    if state is None or not state.groups or collectives is None or ulfm.live():
        return False  # (where a death can be survived, a step writes only once every sum is in)
    if mpi.COUNT_LIMIT is not None and any(g.layout.pack > mpi.COUNT_LIMIT for g in state.groups):
        return False  # a pack MPI cannot take in one call
    merged = collectives.options.merge(options)
    if sum_mode(merged) is not PLAIN or merged.implementation is CommunicationImplementation.HIERARCHICAL:
        return False
    return all(g.xp is np for g in state.groups)


def piece_ranges(layout: Layout, itemsize: int, packed: bool) -> list[tuple[int, int]]:
    """The ``[a, b)`` element ranges of a pack that are summed as one piece: the whole pack when
    ``packed`` (``bytes_per_pack`` set) or sharded, else :data:`PIECES` of it (fewer where a piece
    would hold less than :data:`PIECE_BYTES`)."""
    pack = layout.pack
    n = 1 if packed or layout.sharded else max(1, min(PIECES, pack * itemsize // PIECE_BYTES))
    size = -(-pack // n)
    return [(a, min(a + size, pack)) for a in range(0, pack, size)]


def staging_of(group: Group, packed: bool) -> Staging:
    """The group's staging of every pack for a streamed step, its pieces and which variables each
    holds (made once, kept on the group while ``packed`` stays the same)."""
    lay = group.layout
    ranges = piece_ranges(lay, group.dtype.itemsize, packed)
    if group.stream is None or group.stream.packed != packed:
        pieces = [(k, a, b) for k in range(lay.packs) for a, b in ranges]
        members: list[list[int]] = [[] for _ in pieces]
        for n, (k, a, b) in enumerate(pieces):
            at = k * lay.pack
            members[n] = [
                j for j, (lo, hi) in enumerate(group.params.spans) if lo < hi and lo < at + b and at + a < hi
            ]
        pieces_of: list[list[int]] = [[] for _ in group.params.spans]
        for n, held in enumerate(members):
            for j in held:
                pieces_of[j].append(n)
        group.stream = Staging(packed, placement.zeros(lay.length, group.dtype), pieces, members, pieces_of)
    return group.stream


class _Stream:
    """One streamed step's bookkeeping: what arrived, which pieces started, their requests."""

    def __init__(
        self, collectives: Collectives, groups: list[Group], kind: str, options: CommunicationOptions | None
    ):
        self.collectives, self.kind, self.options = collectives, kind, options
        packed = collectives.options.merge(options).bytes_per_pack > 0
        self.groups = groups
        self.staging = [staging_of(g, packed) for g in groups]
        self.left = [[len(m) for m in s.members] for s in self.staging]  # per piece: gradients to come
        self.arrived = [[False] * len(g.variables) for g in groups]
        # the order pieces start in: the same on every rank
        self.order = [
            (i, n) for i in reversed(range(len(groups))) for n in reversed(range(len(self.left[i])))
        ]
        self.requests: list[Any] = []
        self.pump = progress.Pump()  # runs while sums are in flight and gradients still to come

    def take(self, i: int, j: int, grad: Any) -> None:
        """Gradient of variable ``j`` of group ``i`` into its place; start the pieces it completes."""
        a, b = self.groups[i].params.spans[j]
        self.staging[i].buffer[a:b] = grad.reshape(-1)
        self.arrived[i][j] = True
        left = self.left[i]
        for n in self.staging[i].pieces_of[j]:
            left[n] -= 1
        self.start(final=False)
        if self.requests and not nonblocking.progress(self.requests) and len(self.requests) < len(self.order):
            self.pump.start()  # sums in flight, gradients to come

    def start(self, final: bool) -> None:
        """Start the pieces that are next in order and complete (``final``: all the rest)."""
        while len(self.requests) < len(self.order):
            i, n = self.order[len(self.requests)]
            if not final and self.left[i][n] > 0:
                return
            group, staging = self.groups[i], self.staging[i]
            lay, buf = group.layout, staging.buffer
            k, a, b = staging.pieces[n]
            lo, hi = lay.bounds(k)
            for j in staging.members[n]:  # a gradient that did not come is zeros
                if not self.arrived[i][j]:
                    x, y = group.params.spans[j]
                    buf[max(x, lo) : min(y, hi)] = 0
            if hi > lay.size:  # padding (sharded): a reduce-scatter leaves it undefined
                buf[max(lay.size, lo) : hi] = 0
            part = buf[lo:hi] if b - a == lay.pack else buf[lo + a : lo + b]
            self.requests.append(nonblocking.start(self.collectives, part, scatter=lay.sharded))

    def packs_done(self) -> Iterable[tuple[int, int]]:
        """Wait for the sums in order; ``(group, pack)`` as each pack's last piece completes."""
        for m, ((i, n), request) in enumerate(zip(self.order, self.requests, strict=True)):
            nonblocking.complete(self.collectives, request, kind=self.kind, options=self.options)
            k = self.staging[i].pieces[n][0]
            after = self.order[m + 1] if m + 1 < len(self.order) else None
            if after is None or after[0] != i or self.staging[i].pieces[after[1]][0] != k:
                yield i, k


# Per flat state: id(variable) -> what its gradients were checked against (built variables only, which
# their groups keep alive, so an id is never reused while it is here).
_KNOWN: weakref.WeakKeyDictionary[FlatState, dict[int, tuple[int, int, type, tuple[int, ...], Any]]] = (
    weakref.WeakKeyDictionary()
)


def step(
    collectives: Collectives,
    state: FlatState,
    pairs: Iterable[tuple[Any, Any]],
    where: Callable[[Any], tuple[Group, int]],
    update: pack_step.Update,
    lr: float,
    step: int,
    *,
    name: str,
    kind: str = "apply_gradients",
    pending: BaseException | None = None,
    rule: pack_step.Rule | None = None,
    options: CommunicationOptions | None = None,
) -> bool:
    """One step over ``pairs`` as they come (see the module's docstring).

    ``where(variable)`` gives the variable's group and index there, raising ``KeyError`` for one
    not built and ``MpistratError`` for one this optimizer cannot update. The gradients are not
    kept past their copy, so that their memory is reused while the stream runs. ``pending``: an
    error found before the stream (a learning rate that is not a number), raised on every rank.
    ``rule``: the optimizer's base arguments around the update (``rule.whole``: every sum completes
    first). ``options``: the optimizer's, over the strategy's. Returns whether the step was applied
    (a rule may skip it, on every rank alike).
    """
    stream = _Stream(collectives, state.groups, kind, options)
    index = {id(g): i for i, g in enumerate(state.groups)}
    known = _KNOWN.setdefault(state, {})
    variables: list[Any] = []
    error: BaseException | None = pending
    try:
        for grad, var in pairs:
            if grad is None:
                continue
            seen = known.get(id(var))  # (group index, index there, the variable's array type, shape, dtype)
            if seen is None or (type(grad), grad.shape, grad.dtype) != seen[2:]:
                try:
                    group, j = where(var)
                except KeyError:
                    raise InvalidArgumentError(
                        f"{name}.apply_gradients: variable {var.name!r} is not among those this optimizer "
                        "was built for; a generator's gradients are summed as they come, into the layout "
                        "built before: call optimizer.build(every variable) first, or pass the step that "
                        "adds variables a list"
                    ) from None
                (grad,) = checked_gradients([grad], [var])
                local = local_variable(var).local_array
                seen = known[id(var)] = (index[id(group)], j, type(local), local.shape, local.dtype)
            i, j = seen[0], seen[1]
            if stream.arrived[i][j]:
                raise InvalidArgumentError(
                    f"{name}.apply_gradients: a variable is given more than one gradient (e.g. "
                    f"{var.name!r}); sum its gradients first"
                )
            variables.append(var)
            stream.take(i, j, grad)
        if not variables:
            raise InvalidArgumentError(f"{name}.apply_gradients: no gradients provided for any variable")
    except Exception as exc:  # bad input or the stream itself raised: every rank will raise it
        error = error or exc
    finally:  # the caller's computation is over (or it raised past this step): MPI calls move the rest
        stream.pump.stop()
    stream.start(final=True)
    plan = params = slots = None
    if error is None:
        try:
            plan = state.plan(variables)
            params = [s.group.params.claim() for s in plan.steps]
            slots = [s.group.claim_slots() for s in plan.steps]
        except Exception as exc:
            error = exc
    try:
        collectives.agree(
            kind,
            fingerprint=(0 if plan is None else plan.fingerprint)
            ^ PLAIN.code
            ^ rate_code(lr)
            ^ (0 if rule is None else rule.code),
            describe=lambda: {
                "leaves": [
                    ("gradient reduction", "plain MPI sum", None),
                    ("learning_rate", repr(lr), None),
                    ("base arguments", "none" if rule is None else rule.described, None),
                    *(plan.described if plan else []),
                ],
                "advice": SAME_VARIABLES,
            },
            error=error,
            options=options,
        )
    except BaseException:
        nonblocking.progress(stream.requests)
        for request in stream.requests:
            request.Wait()  # every rank started them all: they complete
        raise
    assert plan is not None and params is not None and slots is not None
    steps = {id(s.group): n for n, s in enumerate(plan.steps)}
    whole: list[pack_step.Pack] = []
    applied = True
    try:
        for i, k in stream.packs_done():
            n = steps.get(id(state.groups[i]))
            if n is None:  # no rank gave this group a gradient
                continue
            s, lay = plan.steps[n], state.groups[i].layout
            lo, hi = lay.bounds(k)
            buf = stream.staging[i].buffer
            grad, base = (buf[lo : lo + lay.per_rank], lay.owned(k)[0]) if lay.sharded else (buf[lo:hi], lo)
            pack = pack_step.Pack(s, k, grad, base, params[n], slots[n])
            if rule is not None and rule.whole:  # updated once every sum is in
                whole.append(pack)
                continue
            if rule is not None:
                rule.before([pack])
            pack_step.update_pack(s, k, grad, base, params[n], slots[n], update, lr, step)
            if rule is not None:
                rule.after([pack])
            pack_step.gather_pack(collectives, s, k, params[n], kind, options)
        if whole:
            assert rule is not None
            applied = pack_step.update_reduced(collectives, whole, rule, lr, step, kind, options)
    except BaseException:  # an update raising on one rank leaves the others in a transfer
        failure.abandon(collectives)
        raise
    if check_level(collectives, options) > 1:
        compare_copies(collectives, plan.written(), kind, options)
    return applied
