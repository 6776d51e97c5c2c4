"""Keras 3's base optimizer arguments, applied to a step over flat packs.

Every optimizer takes ``weight_decay``, ``clipnorm``, ``clipvalue``, ``global_clipnorm``,
``use_ema``, ``ema_momentum``, ``ema_overwrite_frequency`` and ``loss_scale_factor``
(:class:`BaseArguments` checks them). A step applies them in Keras's order, to the summed
gradient: divide by the loss scale, clip (each variable's norm, the global norm, or each
value), decay the weights (``w -= w * weight_decay * lr``, except the variables excluded), run
the optimizer's update, then update the moving average of the weights (the ``average`` slot)
and, every ``ema_overwrite_frequency`` steps, overwrite the weights with it. The global clip's
scale and the decay (when no variable is excluded) are applied block by block in the update's
pass (:meth:`StepRule.update`), not in passes of their own: the same arithmetic per element.

:class:`StepRule` is that work for one step, as :mod:`~mpistrat.training.pack_step` calls it
on this rank's elements of each pack. A norm over whole variables (``clipnorm``,
``global_clipnorm``, LAMB's trust ratios) is a sum of this rank's partial sums of squares per
variable: sharded, one all-reduce of that vector (a float64 per variable, or one scalar for the
global norm), never a gather of gradients; unsharded, every rank holds every element and nothing
is sent. LAMB's sums are taken in the update's pass, block by block, while each block is in cache
(:mod:`~mpistrat.training.trust_ratio`). A loss-scaled step whose summed gradient is not finite is
skipped on every rank: the flag rides in that all-reduce, or is one scalar of its own when sharded
(unsharded every rank holds the same sums, and so the same answer). :meth:`StepRule.replay` does
the step again on other elements of the same variables with the norms it found, without
communication: a keeper's replica of its partner's part of sharded slots
(:mod:`~mpistrat.training.shard_copies`).

>>> BaseArguments.checked("SGD", clipnorm=1.0).whole
True
>>> BaseArguments.checked("SGD", clipnorm=1.0, global_clipnorm=1.0)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
mpistrat.errors.InvalidArgumentError: SGD: only one of clipnorm, clipvalue and global_clipnorm can be set; ...
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat.collectives.fingerprint import code_of
from mpistrat.comm import packing
from mpistrat.errors import InvalidArgumentError
from mpistrat.training import placement
from mpistrat.training.flat_storage import FlatBuffer
from mpistrat.training.norms import Norms
from mpistrat.training.optimizer_state import FlatState, creation_order
from mpistrat.training.pack_step import Pack, Read, Update, joined, update_pack
from mpistrat.training.trust_ratio import TrustRatios

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["BaseArguments", "StepRule", "overwrite_with_slot"]


def _optional(name: str, what: str, value: Any, *, positive: bool = True) -> float | None:
    if value is None:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        raise InvalidArgumentError(
            f"{name}: {what} must be a number {'> 0' if positive else '>= 0'} or None; got {value!r}"
        )
    return float(value)


@dataclasses.dataclass(frozen=True)
class BaseArguments:
    """Keras's base optimizer arguments, checked (see the module's docstring)."""

    weight_decay: float | None = None
    clipnorm: float | None = None
    clipvalue: float | None = None
    global_clipnorm: float | None = None
    use_ema: bool = False
    ema_momentum: float = 0.99
    ema_overwrite_frequency: int | None = None
    loss_scale_factor: float | None = None

    @classmethod
    def checked(cls, name: str, **given: Any) -> BaseArguments:
        """The arguments, or an ``InvalidArgumentError`` naming the first that is wrong."""
        args = cls(**given)
        for what in ("clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor"):
            _optional(name, what, getattr(args, what))
        _optional(name, "weight_decay", args.weight_decay, positive=False)
        clips = {w: getattr(args, w) for w in ("clipnorm", "clipvalue", "global_clipnorm")}
        if sum(v is not None for v in clips.values()) > 1:
            shown = ", ".join(f"{k}={v!r}" for k, v in clips.items())
            raise InvalidArgumentError(
                f"{name}: only one of clipnorm, clipvalue and global_clipnorm can be set; got {shown}"
            )
        if not isinstance(args.use_ema, (bool, np.bool_)):
            raise InvalidArgumentError(f"{name}: use_ema must be True or False; got {args.use_ema!r}")
        momentum = args.ema_momentum
        if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0 <= momentum <= 1:
            raise InvalidArgumentError(f"{name}: ema_momentum must be in [0, 1]; got {momentum!r}")
        frequency = args.ema_overwrite_frequency
        if frequency is not None and (
            isinstance(frequency, bool) or not isinstance(frequency, numbers.Integral) or frequency < 1
        ):
            raise InvalidArgumentError(
                f"{name}: ema_overwrite_frequency must be an integer >= 1 or None; got {frequency!r}"
            )
        return dataclasses.replace(
            args,
            **{w: None if (v := getattr(args, w)) is None else float(v) for w in (
                "weight_decay", "clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor")},
            use_ema=bool(args.use_ema),
            ema_momentum=float(momentum),
            ema_overwrite_frequency=None if frequency is None else int(frequency),
        )  # fmt: skip

    @property
    def whole(self) -> bool:
        """Whether a step needs norms over whole variables (every pack reduced first)."""
        return self.clipnorm is not None or self.global_clipnorm is not None

    @property
    def any(self) -> bool:
        return self != BaseArguments()


class StepRule:
    """One step's work around the optimizer's update (:class:`~mpistrat.training.pack_step.Rule`).

    Args:
        args: the base arguments.
        update: the optimizer's own update of flat blocks (its slots first, in order).
        own_slots: how many slots the update takes (the EMA's ``average`` follows them).
        decays: by ``id(variable)``, whether weight decay applies to it.
        trust_ratio: LAMB's: the update leaves its direction in ``g`` and the rule applies it.
        lr, step: this step's learning rate and number (``iterations`` before it).
        collectives: the strategy's (None: one process).
        sharded: each rank holds its part of each pack (``shard_state=True``): sums of norms travel.
        exact: sums of norms exact (``deterministic=True``).
        loss_scale: a ``LossScaleOptimizer``'s scale: the gradient is divided by it, and a step
            whose sum is not finite is skipped (None: the ``loss_scale_factor``, no skipping).
    """

    def __init__(
        self,
        args: BaseArguments,
        update: Update,
        own_slots: int,
        decays: dict[int, bool],
        trust_ratio: bool,
        lr: float,
        step: int,
        collectives: Collectives | None,
        sharded: bool = False,
        exact: bool = False,
        loss_scale: float | None = None,
        kind: str = "apply_gradients",
    ):
        self.args, self.lr, self.step, self.collectives = args, lr, step, collectives
        self.sharded = sharded and collectives is not None
        self.own_slots, self.trust_ratio, self.kind = own_slots, trust_ratio, kind
        self._decays = decays
        self.loss_scale = args.loss_scale_factor if loss_scale is None else loss_scale
        self.skip_nonfinite = loss_scale is not None
        self.whole = args.whole or trust_ratio or self.skip_nonfinite
        self.exact = exact
        self._inner = update
        # What the update's pass does to each block first (see :meth:`update`): the global clip's
        # scale, and the weight decay when every variable decays.
        self._scale: float | None = None
        self._decay_rate = (args.weight_decay or 0.0) * lr if all(decays.values()) else None
        self.code, self.described = _identity(args, trust_ratio, self.skip_nonfinite)
        # What this step found over the ranks, for replay: the variables' numbers, the clipping
        # scale (one for the global norm, one per variable for clipnorm), LAMB's ratios.
        self._numbers: Norms | None = None
        self._clip_scales: float | np.ndarray | None = None
        self._trust: TrustRatios | None = None

    def decays(self, s: Any, p: int) -> bool:
        """Whether variable ``p`` of group step ``s`` decays."""
        return self._decays[id(s.group.variables[s.present[p]])]

    def update(self, w: Any, g: Any, slots: list[Any], lr: float, step: int) -> None:
        """The optimizer's update of one block, after what the rule does elementwise: the global
        clip's scale of ``g`` and the weight decay of ``w``, in the pass the block is in cache for,
        rather than in passes of their own over every pack."""
        if self._scale is not None:
            g *= self._scale
        if self._decay_rate:
            w -= packing.array_module(w).multiply(w, self._decay_rate, out=placement.empty_like(w))
        self._inner(w, g, slots[: self.own_slots], lr, step)

    # -- before the update: the gradient's transforms, weight decay ------------------------

    def before(self, packs: list[Pack]) -> bool:
        args = self.args
        self._unscale(packs)
        bad = None  # packs whose gradient is not finite on this rank (skip_nonfinite)
        if self.skip_nonfinite:
            bad = float(sum(int(not packing.array_module(g).isfinite(g).all()) for _, _, g, _, _, _ in packs))
        if args.clipnorm is not None or args.global_clipnorm is not None:
            # per variable, or one total (a scalar travels); the flag rides along
            norms = self._numbers = Norms(packs, self.collectives, self.sharded, self.exact, self.kind)
            squares, bad = norms.squares(["grad"], per_variable=args.clipnorm is not None, flag=bad)
            if bad:
                return False
            self._clip_scales = self._scales(squares[0])
        elif bad is not None and self.sharded:
            norms = Norms(packs, self.collectives, self.sharded, self.exact, self.kind)
            if norms.squares([], per_variable=False, flag=bad)[1]:
                return False
        elif bad:
            return False
        self._transform(packs)
        if self.trust_ratio:
            norms = Norms(packs, self.collectives, self.sharded, self.exact, self.kind)
            self._trust = TrustRatios(norms, self.lr)
        return True

    def each_block(self, pack: Pack) -> Read | None:
        """LAMB's: its sums of squares of each block the update's pass wrote (see
        :mod:`~mpistrat.training.trust_ratio`); None for the other rules."""
        return None if self._trust is None else self._trust.each_block(pack)

    def _unscale(self, packs: list[Pack]) -> None:
        if self.loss_scale is not None:
            for _, _, grad, _, _, _ in packs:
                packing.array_module(grad).divide(grad, self.loss_scale, out=grad)

    def _transform(self, packs: list[Pack]) -> None:
        """What ``before`` does once the norms are known: clip, then decay (no communication)."""
        args = self.args
        scales = self._clip_scales
        if isinstance(scales, np.ndarray):
            self._clip(packs, scales)
        elif scales is not None and scales != 1.0:
            self._scale = scales  # applied by update, block by block
        if args.clipvalue is not None:
            for _, _, grad, _, _, _ in packs:
                packing.array_module(grad).clip(grad, -args.clipvalue, args.clipvalue, out=grad)
        if args.weight_decay and self._decay_rate is None:  # some variable is excluded
            self._decay(packs)

    def _scales(self, squares: np.ndarray) -> float | np.ndarray:
        """The clipping scale: one for the global norm, else one per variable."""
        args = self.args
        if args.global_clipnorm is not None:
            norm = math.sqrt(float(squares.sum()))
            c = args.global_clipnorm
            # Keras's: the same scale for every variable, NaN when the norm is not finite
            scale = c * min(1.0 / norm, 1.0 / c) if norm > 0 else 1.0
            return math.nan if not math.isfinite(norm) else scale
        clipnorm = args.clipnorm
        assert clipnorm is not None
        return clipnorm / np.maximum(np.sqrt(squares), clipnorm)

    def _clip(self, packs: list[Pack], scales: np.ndarray) -> None:
        """``clipnorm``: each variable's gradient by its own scale."""
        assert self._numbers is not None
        factors = scales.tolist()  # floats: a multiply in the variables' dtype, not a float64 pass
        for s, k, grad, base, _, _ in packs:
            first = self._numbers.index(s, 0)
            for a, b, p in s.segments[k]:
                if (scale := factors[first + p]) != 1.0:
                    g = grad[a - base : b - base]
                    g *= scale

    def _decay(self, packs: list[Pack]) -> None:
        rate = (self.args.weight_decay or 0.0) * self.lr
        for s, k, _, _, params, _ in packs:
            for a, b in joined([(a, b) for a, b, p in s.segments[k] if self.decays(s, p)]):
                w = params[a:b]
                w -= w * rate

    # -- after the update: LAMB's trust ratios, the moving average ---------------------------

    def after(self, packs: list[Pack]) -> None:
        if self._trust is not None:
            self._trust.finish(packs)
        if self.args.use_ema:
            self._average(packs)

    def replay(self, packs: list[Pack]) -> None:
        """This step again, on other elements of the variables it updated (a keeper's replica of its
        partner's part, in ``packs`` as the partner's own), with the norms :meth:`before` and
        :meth:`after` found over the ranks: the same arithmetic on the same values, so the same bits,
        and no communication. Call it only after a step that ``before`` did not skip."""
        self._unscale(packs)
        self._transform(packs)
        for s, k, grad, base, params, slots in packs:
            update_pack(s, k, grad, base, params, slots, self.update, self.lr, self.step)
        if self._trust is not None:
            self._trust.step(packs)
        if self.args.use_ema:
            self._average(packs)

    def _average(self, packs: list[Pack]) -> None:
        """``average = m * average + (1 - m) * w`` (``average = w`` at the first step), then every
        ``ema_overwrite_frequency`` steps ``w = average``; ``g`` is free to hold the temporary."""
        args, first = self.args, self.step == 0
        momentum = 0.0 if first else args.ema_momentum
        overwrite = (
            args.ema_overwrite_frequency is not None and (self.step + 1) % args.ema_overwrite_frequency == 0
        )
        for s, k, grad, base, params, slots in packs:
            average = slots[self.own_slots]
            xp = packing.array_module(params)
            shift = s.group.layout.slot_start(k) - base
            for a, b in s.updates[k]:
                w, avg, tmp = params[a:b], average[a + shift : b + shift], grad[a - base : b - base]
                if first:
                    avg[...] = w
                else:
                    avg *= momentum
                    xp.multiply(w, 1 - xp.asarray(momentum, w.dtype), out=tmp)
                    avg += tmp
                if overwrite:
                    w[...] = avg


def overwrite_with_slot(
    state: FlatState, slot: str, wanted: set[int] | None, collectives: Collectives | None, kind: str
) -> None:
    """Each variable of ``state`` (of ``wanted`` ids; None: all) set to its slot ``slot``: the
    EMA's ``finalize_variable_values``. Collective: every rank calls it alike (one handshake
    compares the variables); sharded, each rank writes the elements it holds slots for and every
    pack is all-gathered."""
    chosen = [
        (group, j)
        for group in state.groups
        for j, var in enumerate(group.variables)
        if wanted is None or id(var) in wanted
    ]
    if collectives is not None:
        orders = sorted(creation_order(g.variables[j]) for g, j in chosen)
        collectives.agree(kind, fingerprint=code_of(kind, slot, tuple(orders)))
    for group in state.groups:
        mine = [j for g, j in chosen if g is group]
        if not mine:
            continue
        lay, params = group.layout, group.params.claim()
        source = group.slots[slot]
        source = source.array if isinstance(source, FlatBuffer) else source
        for j in mine:
            a, b = group.params.spans[j]
            for lo, hi, at in lay.pieces(a, b, lay.rank):
                params[lo:hi] = source[at : at + hi - lo]
        if lay.sharded:
            assert collectives is not None
            for k in range(lay.packs):
                collectives.all_gather_in_place(params[slice(*lay.bounds(k))], kind=kind)


@functools.lru_cache(maxsize=64)
def _identity(args: BaseArguments, trust_ratio: bool, skip_nonfinite: bool) -> tuple[int, str]:
    """The code and description of what a step's rule does, for the step's handshake."""
    shown = {k: v for k, v in dataclasses.asdict(args).items() if v != getattr(BaseArguments(), k)}
    described = ", ".join(
        [*(f"{k}={v!r}" for k, v in shown.items()), *(["trust ratios"] if trust_ratio else []),
         *(["a loss scale that skips steps not finite"] if skip_nonfinite else [])]
    ) or "none"  # fmt: skip
    return code_of("base arguments", described), described
