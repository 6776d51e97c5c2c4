"""The operations ``mpistrat bench`` measures, each next to its raw mpi4py equivalent.

An operation builds a :class:`Case` for one message size: callables for the
mpistrat path and for the raw path on the same buffers, each paired with a check
of its result against the value computed from how the buffers were filled.
Every rank fills its buffers with ``(rank + 1) * pattern`` (small integers), so
sums are exact in every dtype.

>>> sorted(OPS)[:3]
['all_gather', 'all_gather_uneven', 'all_reduce']
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.comm.mpi import mpi_datatype
from mpistrat.tools.replica import replica_context

__all__ = ["OPS", "Case", "Op", "Setup", "DEFAULT_OPS", "OPT_IN"]

Check = Callable[[Any], bool]


@dataclasses.dataclass
class Case:
    """One operation at one size: what to time and how to check each result."""

    nbytes: int  # the size reported (nccl-tests convention: the whole result's bytes)
    count: int  # elements in that result
    leaves: int
    variants: dict[str, tuple[Callable[[], Any], Check]]


@dataclasses.dataclass
class Setup:
    """What an operation needs to build a case."""

    strategy: mpistrat.MPIStrategy
    comm: MPI.Intracomm  # the raw path's communicator (not the strategy's)
    dtype: np.dtype
    nbytes: int
    leaves: int
    batch: int
    scaling: str
    shard: bool = False  # the optimizer ops: build the mpistrat optimizer with shard_state=True
    rtol: float = 0.0  # how far a result may be from the exact one (compression); 0: equal

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()


@dataclasses.dataclass(frozen=True)
class Op:
    """A measured operation: its two sides in words, its context and bus-bandwidth factor."""

    name: str
    mpistrat: str
    raw: str
    raw2: str | None
    context: str  # "replica" (inside one strategy.run), "cross_replica" (in scope) or "none"
    busbw: Callable[[int], float]
    build: Callable[[Setup], Case]


def _pattern(count: int, dtype: np.dtype) -> np.ndarray:
    return (np.arange(count) % 8 + 1).astype(dtype)


def _filled(count: int, s: Setup) -> tuple[np.ndarray, np.ndarray]:
    """This rank's buffer and the sum of every rank's buffer."""
    pattern = _pattern(count, s.dtype)
    mine = pattern * s.dtype.type(s.rank + 1)
    total = pattern * s.dtype.type(s.size * (s.size + 1) // 2)
    return mine, total


def _same(got: Any, want: np.ndarray, rtol: float) -> bool:
    if rtol == 0:
        return bool(np.array_equal(got, want))
    return bool(np.allclose(got, want, rtol=rtol, atol=0.0))


def _equal(want: np.ndarray, rtol: float = 0.0) -> Check:
    return lambda got: _same(got, want, rtol)


def _split(count: int, parts: int) -> list[int]:
    """``count`` elements in ``parts`` near-equal positive pieces."""
    base, extra = divmod(count, parts)
    return [base + (i < extra) for i in range(parts)]


def _allreduce_factor(n: int) -> float:
    return 2.0 * (n - 1) / n


def _allgather_factor(n: int) -> float:
    return (n - 1) / n


# -- all_reduce of one array -------------------------------------------------------------


def _all_reduce(s: Setup) -> Case:
    count = max(1, s.nbytes // s.dtype.itemsize)
    x, want = _filled(count, s)
    recv = np.empty_like(x)
    ctx = replica_context()
    comm = s.comm

    def raw() -> np.ndarray:
        comm.Allreduce(x, recv, op=MPI.SUM)
        return recv

    check = _equal(want, s.rtol)
    return Case(
        x.nbytes, count, 1, {"mpistrat": (lambda: ctx.all_reduce("sum", x), check), "raw": (raw, check)}
    )


# -- all_reduce of a nest of K leaves of the same total size --------------------------


def _nest(count: int, s: Setup) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    x, want = _filled(count, s)
    names = [f"layer{k:03d}" for k in range(s.leaves)]
    bounds = np.cumsum([0, *_split(count, s.leaves)])
    tree = {n: x[a:b].copy() for n, a, b in zip(names, bounds[:-1], bounds[1:], strict=True)}
    wants = {n: want[a:b] for n, a, b in zip(names, bounds[:-1], bounds[1:], strict=True)}
    return tree, wants


def _check_nest(wants: dict[str, np.ndarray], rtol: float = 0.0) -> Check:
    def check(got: Any) -> bool:
        return len(got) == len(wants) and all(_same(got[k], w, rtol) for k, w in wants.items())

    return check


def _all_reduce_nest(s: Setup) -> Case:
    count = max(s.leaves, s.nbytes // s.dtype.itemsize)
    tree, wants = _nest(count, s)
    recvs = {k: np.empty_like(v) for k, v in tree.items()}
    flat, flat_recv = np.concatenate(list(tree.values())), np.empty(count, s.dtype)
    ctx = replica_context()
    comm = s.comm

    def raw() -> dict[str, np.ndarray]:
        for k, v in tree.items():
            comm.Allreduce(v, recvs[k], op=MPI.SUM)
        return recvs

    def raw_one() -> np.ndarray:
        comm.Allreduce(flat, flat_recv, op=MPI.SUM)
        return flat_recv

    check = _check_nest(wants, s.rtol)
    return Case(
        count * s.dtype.itemsize,
        count,
        s.leaves,
        {
            "mpistrat": (lambda: ctx.all_reduce("sum", tree), check),
            "raw": (raw, check),
            "raw2": (raw_one, _equal(np.concatenate(list(wants.values())))),
        },
    )


# -- all_gather, even and uneven ------------------------------------------------------


def _gather_counts(total: int, n: int, uneven: bool) -> list[int]:
    """Elements each rank contributes; uneven: in proportion to rank + 1, at least one each."""
    if not uneven:
        return [max(1, total // n)] * n
    weights = [(r + 1) / (n * (n + 1) / 2) for r in range(n)]
    counts = [max(1, int(total * w)) for w in weights]
    counts[-1] = max(1, total - sum(counts[:-1]))
    return counts


def _all_gather(s: Setup, uneven: bool) -> Case:
    counts = _gather_counts(max(1, s.nbytes // s.dtype.itemsize), s.size, uneven)
    pieces = [_pattern(c, s.dtype) * s.dtype.type(r + 1) for r, c in enumerate(counts)]
    x, want = pieces[s.rank], np.concatenate(pieces)
    ctx = replica_context()
    comm = s.comm
    datatype = mpi_datatype(s.dtype)
    check = _equal(want, s.rtol)

    if uneven:

        def raw() -> np.ndarray:
            sizes = np.empty(comm.Get_size(), dtype=np.int64)
            comm.Allgather(np.array([x.size], dtype=np.int64), sizes)
            displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
            recv = np.empty(int(sizes.sum()), dtype=x.dtype)
            comm.Allgatherv(x, [recv, sizes.tolist(), displs.tolist(), datatype])
            return recv

    else:
        recv = np.empty(want.size, dtype=s.dtype)

        def raw() -> np.ndarray:
            comm.Allgather(x, recv)
            return recv

    return Case(
        want.nbytes,
        want.size,
        1,
        {"mpistrat": (lambda: ctx.all_gather(x, axis=0), check), "raw": (raw, check)},
    )


# -- merge_call -----------------------------------------------------------------------


def _sum_values(strategy: Any, value: Any) -> np.ndarray:
    return sum(value.values[1:], value.values[0].copy())


def _merge_call(s: Setup) -> Case:
    count = max(1, s.nbytes // s.dtype.itemsize)
    x, want = _filled(count, s)
    ctx = replica_context()
    comm = s.comm

    def raw() -> np.ndarray:
        values = comm.gather(x, root=0)
        result = _sum_values(None, mpistrat.PerReplica(values)) if values is not None else None
        return comm.bcast(result, root=0)

    check = _equal(want, s.rtol)
    return Case(
        x.nbytes,
        count,
        1,
        {"mpistrat": (lambda: ctx.merge_call(_sum_values, args=(x,)), check), "raw": (raw, check)},
    )


# -- Strategy.reduce in cross-replica context -----------------------------------------


def _reduce(s: Setup) -> Case:
    count = max(1, s.nbytes // s.dtype.itemsize)
    x, want = _filled(count, s)
    recv = np.empty_like(x)
    strategy, comm = s.strategy, s.comm

    def raw() -> np.ndarray:
        comm.Allreduce(x, recv, op=MPI.SUM)
        return recv

    check = _equal(want, s.rtol)
    return Case(
        x.nbytes,
        count,
        1,
        {"mpistrat": (lambda: strategy.reduce("sum", x, axis=None), check), "raw": (raw, check)},
    )


# -- a strategy.run step with a fused (MEAN) gradient all-reduce ----------------------


def _mean(total: np.ndarray, n: int) -> np.ndarray:
    return np.true_divide(total, n)


def _run_step(s: Setup) -> Case:
    count = max(s.leaves, s.nbytes // s.dtype.itemsize)
    grads, sums = _nest(count, s)
    wants = {k: _mean(v, s.size) for k, v in sums.items()}
    strategy, comm, n = s.strategy, s.comm, s.size
    names = list(grads)
    bounds = np.cumsum([0, *[grads[k].size for k in names]]).tolist()

    def step(g: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return replica_context().all_reduce("mean", g)

    def raw() -> dict[str, np.ndarray]:
        buf = np.concatenate([grads[k] for k in names])
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        buf = _mean(buf, n)
        return {k: buf[a:b] for k, a, b in zip(names, bounds[:-1], bounds[1:], strict=True)}

    check = _check_nest(wants, s.rtol)
    return Case(
        count * s.dtype.itemsize,
        count,
        s.leaves,
        {"mpistrat": (lambda: strategy.run(step, args=(grads,)), check), "raw": (raw, check)},
    )


# -- a data-parallel training step with compute (for strong and weak scaling) ---------

_FEATURES = 64


def _train_step(s: Setup) -> Case:
    """Least squares on a linear model: gradients of ``K`` weight leaves, then a fused MEAN.

    The weights are zero, so rank ``r``'s gradient is ``-(r+1)^2 X^T Y / b`` for fixed
    ``X`` and ``Y``, and the mean over ranks is known in closed form.
    """
    count = max(s.leaves, s.nbytes // s.dtype.itemsize)
    d = min(_FEATURES, count)
    h = max(s.leaves, count // d)
    widths = _split(h, s.leaves)
    local = max(1, s.batch // s.size) if s.scaling == "strong" else max(1, s.batch)
    rng = np.random.default_rng(0)
    dtype = s.dtype if s.dtype.kind == "f" else np.dtype(np.float32)
    base_x = rng.standard_normal((local, d)).astype(dtype)
    base_y = [rng.standard_normal((local, w)).astype(dtype) for w in widths]
    x = base_x * dtype.type(s.rank + 1)
    ys = [y * dtype.type(s.rank + 1) for y in base_y]
    names = [f"layer{k:03d}" for k in range(len(widths))]
    weights = {k: np.zeros((d, w), dtype) for k, w in zip(names, widths, strict=True)}
    scale = sum((r + 1) ** 2 for r in range(s.size)) / s.size
    wants = {
        k: -(base_x.T.astype(np.float64) @ y) * scale / local for k, y in zip(names, base_y, strict=True)
    }
    strategy, comm, n = s.strategy, s.comm, s.size
    bounds = np.cumsum([0, *[d * w for w in widths]]).tolist()

    def grads() -> dict[str, np.ndarray]:
        return {k: x.T @ (x @ weights[k] - y) / dtype.type(local) for k, y in zip(names, ys, strict=True)}

    def step() -> dict[str, np.ndarray]:
        return replica_context().all_reduce("mean", grads())

    def raw() -> dict[str, np.ndarray]:
        g = grads()
        buf = np.concatenate([g[k].reshape(-1) for k in names])
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        buf /= dtype.type(n)
        return {k: buf[a:b].reshape(d, -1) for k, a, b in zip(names, bounds[:-1], bounds[1:], strict=True)}

    tol = max(1e-3 if dtype.itemsize <= 4 else 1e-9, s.rtol)

    def check(got: Any) -> bool:
        return all(
            np.allclose(got[k], w, rtol=tol, atol=tol * float(np.abs(w).max() + 1)) for k, w in wants.items()
        )

    total = d * h
    return Case(
        total * dtype.itemsize,
        total,
        len(names),
        {"mpistrat": (lambda: strategy.run(step), check), "raw": (raw, check)},
    )


# -- an optimizer step: apply_gradients next to what Horovod's DistributedOptimizer does ---


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
    bounds = np.cumsum([0, *_split(count, s.leaves)]).tolist()
    spans = list(itertools.pairwise(bounds))
    where = np.arange(count) % 8  # _pattern: element i is where[i] + 1
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


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op(
            "all_reduce",
            "all_reduce(SUM) of one array",
            "Allreduce",
            None,
            "replica",
            _allreduce_factor,
            _all_reduce,
        ),
        Op(
            "all_reduce_nest",
            "all_reduce(SUM) of a nest of K leaves, same total",
            "K x Allreduce",
            "1 x Allreduce of the total",
            "replica",
            _allreduce_factor,
            _all_reduce_nest,
        ),
        Op(
            "all_gather",
            "all_gather(axis=0), even sizes",
            "Allgather",
            None,
            "replica",
            _allgather_factor,
            lambda s: _all_gather(s, uneven=False),
        ),
        Op(
            "all_gather_uneven",
            "all_gather(axis=0), rank r sends ~(r+1) parts",
            "Allgather(counts) + Allgatherv",
            None,
            "replica",
            _allgather_factor,
            lambda s: _all_gather(s, uneven=True),
        ),
        Op(
            "merge_call",
            "merge_call(sum of PerReplica)",
            "gather + bcast",
            None,
            "replica",
            lambda n: 1.0,
            _merge_call,
        ),
        Op(
            "reduce",
            "Strategy.reduce(SUM, axis=None)",
            "Allreduce",
            None,
            "cross_replica",
            _allreduce_factor,
            _reduce,
        ),
        Op(
            "run_step",
            "strategy.run(step): all_reduce(MEAN) of K gradients",
            "concatenate + Allreduce + divide",
            None,
            "none",
            _allreduce_factor,
            _run_step,
        ),
        Op(
            "train_step",
            "strategy.run: K linear-layer gradients + all_reduce(MEAN)",
            "same gradients + concatenate + Allreduce",
            None,
            "none",
            _allreduce_factor,
            _train_step,
        ),
        Op(
            "apply_gradients_sgd",
            "SGD(momentum=0.9).apply_gradients, K variables",
            "concatenate + Allreduce + SGD update by hand, per variable",
            "flat params/slots + Allreduce + one vectorised update",
            "none",
            _allreduce_factor,
            lambda s: _apply_gradients(s, _SGD),
        ),
        Op(
            "apply_gradients_adam",
            "Adam().apply_gradients, K variables",
            "concatenate + Allreduce + Adam update by hand, per variable",
            "flat params/slots + Allreduce + one vectorised update",
            "none",
            _allreduce_factor,
            lambda s: _apply_gradients(s, _ADAM),
        ),
    )
}

# What a plain ``mpistrat bench`` runs. Opt-in: train_step (compute-bound, for scaling studies) and
# the optimizer steps: 64 variables cost ~6-14 ms a step with today's apply_gradients, so over the
# default sweep they took 5.3 minutes at 2 ranks, where every other op together took 3.
OPT_IN = ("train_step", "apply_gradients_sgd", "apply_gradients_adam")
DEFAULT_OPS = [name for name in OPS if name not in OPT_IN]
