"""The optimizer steps ``mpistrat bench`` measures: ``apply_gradients`` next to what Horovod's
``DistributedOptimizer`` does (one fused Allreduce, then each variable's update by hand) and
next to the flat step a user would write (the weights and each slot one array).

A step's result is checked against the weights after however many steps the side has taken, so
the harness may call a side any number of times: SGD's and Adam's from their closed form
(``_Rule.drift``), the others' from the flat step run in float64 on the summed gradient.
SGD, Adam, AdamW, RMSprop and LAMB, the last three also with ``global_clipnorm`` (a clip that
acts: the summed gradient's norm is above it).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.tools.bench_case import Case, Setup, split

__all__ = ["RULES", "apply_gradients"]


@dataclasses.dataclass(frozen=True)
class _Rule:
    """An optimizer, its update written out by hand, and its closed form on a constant gradient."""

    make: Callable[[bool], mpistrat.optimizers.Optimizer]  # make(shard): shard_state=True when shard
    slots: int
    # update(step, w, g, slots): one step on one leaf, in place; step counts from 0 as in _apply_dense;
    # g is the leaf's part of the fused buffer, which it may overwrite
    update: Callable[[int, np.ndarray, np.ndarray, list[np.ndarray]], None]
    # flat(step, w, g, slots, scratch, starts): the same step on flat arrays holding every leaf, in
    # place: g is the step's own buffer, which it overwrites; scratch a buffer of the same size;
    # starts where each leaf begins (for norms per leaf)
    flat: Callable[[int, np.ndarray, np.ndarray, list[np.ndarray], np.ndarray, np.ndarray], None]
    # drift(k, g): w_k - w_0 after k steps from zero slots, gradient g every step (float64,
    # elementwise); None: the reference runs ``flat`` in float64
    drift: Callable[[int, np.ndarray], np.ndarray] | None
    clip: float | None = None  # global_clipnorm (the hand-written steps clip the fused sum by hand)


_LR, _MOMENTUM = 1e-3, 0.9
_B1, _B2, _EPS = 0.9, 0.999, 1e-7


def _sgd_update(step: int, w: np.ndarray, g: np.ndarray, slots: list[np.ndarray]) -> None:
    (velocity,) = slots
    velocity *= _MOMENTUM  # velocity = momentum * velocity - lr * g
    velocity -= _LR * g
    w += velocity


def _sgd_flat(step: int, w: np.ndarray, g: np.ndarray, slots: list[np.ndarray], *_: np.ndarray) -> None:
    (velocity,) = slots
    velocity *= _MOMENTUM
    g *= _LR
    velocity -= g
    w += velocity


def _sgd_drift(k: int, g: np.ndarray) -> np.ndarray:
    # v_j = -lr g (1 - m^j) / (1 - m), and w_k - w_0 is their sum over j = 1..k
    m = _MOMENTUM
    return -_LR * g / (1 - m) * (k - m * (1 - m**k) / (1 - m))


def _adam_update(step: int, w: np.ndarray, g: np.ndarray, slots: list[np.ndarray]) -> None:
    m, v = slots
    t = step + 1
    lr_t = _LR * math.sqrt(1.0 - _B2**t) / (1.0 - _B1**t)
    m += (g - m) * (1.0 - _B1)
    v += (g * g - v) * (1.0 - _B2)
    w -= lr_t * m / (np.sqrt(v) + _EPS)


def _adam_flat(step: int, w: np.ndarray, g: np.ndarray, slots: list[np.ndarray], *_: np.ndarray) -> None:
    m, v = slots
    t = step + 1
    lr_t = _LR * math.sqrt(1.0 - _B2**t) / (1.0 - _B1**t)
    m *= _B1  # m = b1 m + (1 - b1) g, g then free to hold the temporaries
    g *= 1.0 - _B1
    m += g
    np.square(g, out=g)  # v = b2 v + (1 - b2) g^2, from ((1 - b1) g)^2
    g *= (1.0 - _B2) / (1.0 - _B1) ** 2
    v *= _B2
    v += g
    np.sqrt(v, out=g)  # w -= lr_t m / (sqrt(v) + eps)
    g += _EPS
    np.divide(m, g, out=g)
    g *= lr_t
    w -= g


def _adam_drift(k: int, g: np.ndarray) -> np.ndarray:
    # a constant g gives m_t = g (1 - b1^t) and v_t = g^2 (1 - b2^t), so the bias corrections cancel
    # but for epsilon: step t moves w by -lr s_t g / (|g| s_t + eps), s_t = sqrt(1 - b2^t)
    s = np.sqrt(1.0 - _B2 ** np.arange(1, k + 1, dtype=np.float64))[:, None]
    return -(_LR * s * g / (np.abs(g) * s + _EPS)).sum(axis=0)


_SGD = _Rule(
    lambda shard: mpistrat.optimizers.SGD(learning_rate=_LR, momentum=_MOMENTUM, shard_state=shard),
    1,
    _sgd_update,
    _sgd_flat,
    _sgd_drift,
)
_ADAM = _Rule(
    lambda shard: mpistrat.optimizers.Adam(
        learning_rate=_LR, beta_1=_B1, beta_2=_B2, epsilon=_EPS, shard_state=shard
    ),
    2,
    _adam_update,
    _adam_flat,
    _adam_drift,
)

_WD, _RHO, _CLIP = 0.004, 0.9, 1.0  # AdamW's default decay; RMSprop's rho; a global norm that clips


def _adamw_update(step: int, w: np.ndarray, g: np.ndarray, slots: list[np.ndarray]) -> None:
    w -= w * (_WD * _LR)
    _adam_update(step, w, g, slots)


def _adamw_flat(
    step: int, w: np.ndarray, g: np.ndarray, slots: list[np.ndarray], scratch: np.ndarray, *_: np.ndarray
) -> None:
    np.multiply(w, _WD * _LR, out=scratch)  # w -= w * weight_decay * lr, then Adam's step
    w -= scratch
    _adam_flat(step, w, g, slots)


def _rmsprop_update(step: int, w: np.ndarray, g: np.ndarray, slots: list[np.ndarray]) -> None:
    (v,) = slots
    v *= _RHO
    v += (1 - _RHO) * g * g
    w -= _LR * g / np.sqrt(v + _EPS)


def _rmsprop_flat(
    step: int, w: np.ndarray, g: np.ndarray, slots: list[np.ndarray], scratch: np.ndarray, *_: np.ndarray
) -> None:
    (v,) = slots
    np.square(g, out=scratch)  # v = rho v + (1 - rho) g^2
    scratch *= 1 - _RHO
    v *= _RHO
    v += scratch
    np.add(v, _EPS, out=scratch)  # w -= lr g / sqrt(v + eps)
    np.sqrt(scratch, out=scratch)
    g *= _LR
    g /= scratch
    w -= g


def _lamb_direction(step: int, g: np.ndarray, slots: list[np.ndarray], scratch: np.ndarray) -> None:
    """Adam's direction m_hat / (sqrt(v_hat) + eps) into g, the moments updated."""
    m, v = slots
    t = step + 1
    np.square(g, out=scratch)
    scratch *= 1 - _B2
    v *= _B2
    v += scratch
    m *= _B1
    g *= 1 - _B1
    m += g
    np.divide(m, 1 - _B1**t, out=g)
    np.divide(v, 1 - _B2**t, out=scratch)
    np.sqrt(scratch, out=scratch)
    scratch += _EPS
    g /= scratch


def _lamb_update(step: int, w: np.ndarray, g: np.ndarray, slots: list[np.ndarray]) -> None:
    _lamb_direction(step, g, slots, np.empty_like(g))  # g: the fused buffer's, overwritten each step
    w_norm, u_norm = np.linalg.norm(w), np.linalg.norm(g)
    w -= (w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0) * _LR * g


def _lamb_flat(
    step: int, w: np.ndarray, g: np.ndarray, slots: list[np.ndarray], scratch: np.ndarray, starts: np.ndarray
) -> None:
    _lamb_direction(step, g, slots, scratch)
    np.square(w, out=scratch)  # per leaf: the norms of w and of the direction
    w_norm = np.sqrt(np.add.reduceat(scratch, starts))
    np.square(g, out=scratch)
    u_norm = np.sqrt(np.add.reduceat(scratch, starts))
    ratio = np.where((w_norm > 0) & (u_norm > 0), w_norm / np.where(u_norm > 0, u_norm, 1), 1.0) * _LR
    sizes = np.diff(np.append(starts, w.size))
    g *= np.repeat(ratio.astype(w.dtype), sizes)
    w -= g


def _rules() -> dict[str, _Rule]:
    opt = mpistrat.optimizers
    out = {
        "sgd": _Rule(
            lambda shard: opt.SGD(_LR, momentum=_MOMENTUM, shard_state=shard),
            1,
            _sgd_update,
            _sgd_flat,
            _sgd_drift,
        ),
        "adam": _Rule(
            lambda shard: opt.Adam(_LR, _B1, _B2, _EPS, shard_state=shard),
            2,
            _adam_update,
            _adam_flat,
            _adam_drift,
        ),
    }
    for clip in (None, _CLIP):
        suffix = "_clip" if clip else ""

        def adamw(shard: bool, clip: float | None = clip) -> mpistrat.optimizers.Optimizer:
            return opt.AdamW(_LR, _WD, _B1, _B2, _EPS, shard_state=shard, global_clipnorm=clip)

        def rmsprop(shard: bool, clip: float | None = clip) -> mpistrat.optimizers.Optimizer:
            return opt.RMSprop(_LR, _RHO, epsilon=_EPS, shard_state=shard, global_clipnorm=clip)

        def lamb(shard: bool, clip: float | None = clip) -> mpistrat.optimizers.Optimizer:
            return opt.Lamb(_LR, _B1, _B2, _EPS, shard_state=shard, global_clipnorm=clip)

        out[f"adamw{suffix}"] = _Rule(adamw, 2, _adamw_update, _adamw_flat, None, clip)
        out[f"rmsprop{suffix}"] = _Rule(rmsprop, 1, _rmsprop_update, _rmsprop_flat, None, clip)
        out[f"lamb{suffix}"] = _Rule(lamb, 2, _lamb_update, _lamb_flat, None, clip)
    return out


RULES = _rules()


def _clipped(g: np.ndarray, clip: float | None) -> None:
    """The summed gradient scaled to the global norm ``clip`` (Keras's global_clipnorm), in place."""
    if clip is not None:
        norm = math.sqrt(float(np.dot(g, g)))
        if norm > clip:
            g *= clip / norm


class _Simulated:
    """The flat step in float64 on the summed gradient: the reference of a rule without a closed form.

    Stepped forward as the sides ask; a step count before the last two asked for starts again from 0.
    """

    def __init__(self, rule: _Rule, start: np.ndarray, summed: np.ndarray, starts: np.ndarray):
        self.rule, self.start, self.summed, self.starts = rule, start, summed, starts
        self.scratch = np.empty_like(start)
        self._restart()

    def _restart(self) -> None:
        self.k, self.weights = 0, self.start.copy()
        self.slots = [np.zeros_like(self.start) for _ in range(self.rule.slots)]
        self.kept: dict[int, np.ndarray] = {0: self.weights.copy()}

    def at(self, k: int) -> np.ndarray:
        if k in self.kept:
            return self.kept[k]
        if k < self.k:
            self._restart()
        while self.k < k:
            g = self.summed.copy()
            _clipped(g, self.rule.clip)
            self.rule.flat(self.k, self.weights, g, self.slots, self.scratch, self.starts)
            self.k += 1
        self.kept = {j: w for j, w in self.kept.items() if j >= k - 1}  # this step and the one before
        self.kept[k] = self.weights.copy()
        return self.kept[k]


def apply_gradients(name: str) -> Callable[[Setup], Case]:
    """The case builder of ``RULES[name]`` (see :func:`_apply_gradients`)."""
    return functools.partial(_apply_gradients, rule=RULES[name])


def _apply_gradients(s: Setup, rule: _Rule) -> Case:
    """One optimizer step on ``K`` variables holding ``P = nbytes / itemsize`` parameters in all.

    Rank ``r``'s gradient is ``(r+1) * pattern`` at every step, so the summed gradient
    ``G`` is known and the weights after ``k`` steps have a closed form (``rule.drift``).
    Each side counts its own steps and returns the count; the check compares its
    weights (and, for mpistrat, ``iterations``) with the closed form at that count, so
    the harness may call a side any number of times. One untimed step per side at
    build time creates the optimizer's slots, which a timed step must not pay for.
    ``raw`` updates each variable in turn, as Horovod does; ``raw2`` keeps the weights
    and each slot in one flat array and updates them all in a few vectorised passes.
    """
    dtype = s.dtype if s.dtype.kind == "f" and s.dtype.itemsize >= 4 else np.dtype(np.float32)
    count = max(s.leaves, s.nbytes // dtype.itemsize)
    bounds = np.cumsum([0, *split(count, s.leaves)]).tolist()
    spans = list(itertools.pairwise(bounds))
    where = np.arange(count) % 8  # bench_case.pattern: element i is where[i] + 1
    pattern = (where + 1).astype(dtype)
    grads = [pattern[a:b] * dtype.type(s.rank + 1) for a, b in spans]
    values = np.arange(1.0, 9.0) * (s.size * (s.size + 1) // 2)  # the summed gradient is values[where]
    initial = ((np.arange(count) % 5 + 1) / 4).astype(dtype)
    start = initial.astype(np.float64)
    eps = float(np.finfo(dtype).eps)

    starts = np.array(bounds[:-1], np.int64)
    simulated = None if rule.drift is not None else _Simulated(rule, start, values[where], starts)

    @functools.lru_cache(maxsize=1)  # both sides ask for the same k in turn
    def reference(k: int) -> tuple[np.ndarray, float]:
        if simulated is not None:
            want = simulated.at(k)
        else:
            assert rule.drift is not None
            want = start + rule.drift(k, values)[where]
        # rounding accumulates in the weights step by step: float32 SGD is 3e-5 off after 3000 steps
        return want, eps * (64 + k) * (float(np.abs(want).max()) + 1)

    def weights_at(k: int, weights: list[np.ndarray]) -> bool:
        want, tol = reference(k)
        # the largest error, not np.allclose: a third of the passes over the weights (NaN fails too)
        return all(bool(np.abs(w - want[a:b]).max() <= tol) for w, (a, b) in zip(weights, spans, strict=True))

    strategy, comm = s.strategy, s.comm
    with strategy.scope():
        variables = [mpistrat.Variable(initial[a:b], name=f"layer{i:03d}") for i, (a, b) in enumerate(spans)]
        opt = rule.make(s.shard)
    steps = {"mpistrat": 0, "raw": 0, "raw2": 0}

    def step() -> int:
        strategy.run(lambda: opt.apply_gradients(zip(grads, variables, strict=True)))
        steps["mpistrat"] += 1
        return steps["mpistrat"]

    def check(k: int) -> bool:
        return int(np.asarray(opt.iterations)) == k and weights_at(k, [np.asarray(v) for v in variables])

    # Horovod: gradients copied into one fusion buffer, one in-place SUM on a plain duplicate of the
    # communicator (the optimizer sums; scale the loss by the global batch for a mean), then every
    # rank applies the same update to its own copy of the weights and slots.
    weights = [initial[a:b].copy() for a, b in spans]
    slots = [[np.zeros(b - a, dtype) for _ in range(rule.slots)] for a, b in spans]
    fused = np.empty(count, dtype)

    def raw() -> int:
        np.concatenate(grads, out=fused)
        comm.Allreduce(MPI.IN_PLACE, fused, op=MPI.SUM)
        _clipped(fused, rule.clip)
        for w, (a, b), slot in zip(weights, spans, slots, strict=True):
            rule.update(steps["raw"], w, fused[a:b], slot)
        steps["raw"] += 1
        return steps["raw"]

    # The flat step a user would write: the weights and each slot one array for all K variables
    # (a variable's weights are a view of it), the same fused Allreduce, then whole-array passes.
    params = initial.copy()
    views = [params[a:b] for a, b in spans]
    flat_slots = [np.zeros(count, dtype) for _ in range(rule.slots)]
    flat_grads, scratch = np.empty(count, dtype), np.empty(count, dtype)

    def raw_flat() -> int:
        np.concatenate(grads, out=flat_grads)
        comm.Allreduce(MPI.IN_PLACE, flat_grads, op=MPI.SUM)
        _clipped(flat_grads, rule.clip)
        rule.flat(steps["raw2"], params, flat_grads, flat_slots, scratch, starts)
        steps["raw2"] += 1
        return steps["raw2"]

    step(), raw(), raw_flat()
    return Case(
        count * dtype.itemsize,
        count,
        s.leaves,
        {
            "mpistrat": (step, check),
            "raw": (raw, lambda k: weights_at(k, weights)),
            "raw2": (raw_flat, lambda k: weights_at(k, views)),
        },
    )
