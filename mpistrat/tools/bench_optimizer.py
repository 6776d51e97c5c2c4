"""The optimizer steps ``mpistrat bench`` measures: ``apply_gradients`` next to what Horovod's
``DistributedOptimizer`` does (one fused Allreduce, then each variable's update by hand) and
next to the flat step a user would write (the weights and each slot one array).

A step's result is checked against the closed form of the weights after however many steps
the side has taken (``_Rule.drift``), so the harness may call a side any number of times.
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

__all__ = ["apply_gradients_adam", "apply_gradients_sgd"]


@dataclasses.dataclass(frozen=True)
class _Rule:
    """An optimizer, its update written out by hand, and its closed form on a constant gradient."""

    make: Callable[[bool], mpistrat.optimizers.Optimizer]  # make(shard): shard_state=True when shard
    slots: int
    # update(step, w, g, slots): one step on one leaf, in place; step counts from 0 as in _apply_dense
    update: Callable[[int, np.ndarray, np.ndarray, list[np.ndarray]], None]
    # flat(step, w, g, slots): the same step on flat arrays holding every leaf, in place and
    # without temporaries: g is the step's own buffer, which it overwrites
    flat: Callable[[int, np.ndarray, np.ndarray, list[np.ndarray]], None]
    # drift(k, g): w_k - w_0 after k steps from zero slots, gradient g every step (float64, elementwise)
    drift: Callable[[int, np.ndarray], np.ndarray]


_LR, _MOMENTUM = 1e-3, 0.9
_B1, _B2, _EPS = 0.9, 0.999, 1e-7


def _sgd_update(step: int, w: np.ndarray, g: np.ndarray, slots: list[np.ndarray]) -> None:
    (velocity,) = slots
    velocity *= _MOMENTUM  # velocity = momentum * velocity - lr * g
    velocity -= _LR * g
    w += velocity


def _sgd_flat(step: int, w: np.ndarray, g: np.ndarray, slots: list[np.ndarray]) -> None:
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


def _adam_flat(step: int, w: np.ndarray, g: np.ndarray, slots: list[np.ndarray]) -> None:
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

    @functools.lru_cache(maxsize=1)  # both sides ask for the same k in turn
    def reference(k: int) -> tuple[np.ndarray, float]:
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
        for w, (a, b), slot in zip(weights, spans, slots, strict=True):
            rule.update(steps["raw"], w, fused[a:b], slot)
        steps["raw"] += 1
        return steps["raw"]

    # The flat step a user would write: the weights and each slot one array for all K variables
    # (a variable's weights are a view of it), the same fused Allreduce, then whole-array passes.
    params = initial.copy()
    views = [params[a:b] for a, b in spans]
    flat_slots = [np.zeros(count, dtype) for _ in range(rule.slots)]
    flat_grads = np.empty(count, dtype)

    def raw_flat() -> int:
        np.concatenate(grads, out=flat_grads)
        comm.Allreduce(MPI.IN_PLACE, flat_grads, op=MPI.SUM)
        rule.flat(steps["raw2"], params, flat_grads, flat_slots)
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


def apply_gradients_sgd(s: Setup) -> Case:
    """``SGD(momentum=0.9).apply_gradients`` on ``s.leaves`` variables (see :func:`_apply_gradients`)."""
    return _apply_gradients(s, _SGD)


def apply_gradients_adam(s: Setup) -> Case:
    """``Adam().apply_gradients`` on ``s.leaves`` variables (see :func:`_apply_gradients`)."""
    return _apply_gradients(s, _ADAM)
