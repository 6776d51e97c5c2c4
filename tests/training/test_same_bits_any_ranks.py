"""The same weight bits at any rank count: ``deterministic=True`` with gradient accumulation.

A global batch of M fixed microbatches is spread over R ranks, K = M / R each, every rank
scaling its gradients by 1 / R (a loss scaled by the global batch). The optimizer applies the
exact sum of every microbatch's gradient divided by K, rounded once, so at R = 1, 2 and 4 the
weights after each update are the bits of one serial reference, independent of R: the exact
sum of the M gradients in rational arithmetic (``fractions.Fraction``), divided by M and
rounded once to the variable's dtype, then the update written out in NumPy in the optimizer's
documented order of operations. A checkpoint saved between cycles at one R and restored at
another continues the same run.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat
from mpistrat import CommunicationOptions
from mpistrat.optimizers import SGD, Adagrad, Adam, AdamW, Lamb, RMSprop
from tests.conftest import WORLD, all_ranks_agree

M = 4  # microbatches per update
UPDATES = 2
LR, B1, B2, EPS = 0.1, 0.9, 0.999, 1e-7
SHAPES = {"w": ((5, 7), np.float32), "b": ((3,), np.float32), "d": ((4,), np.float64)}
EXACT = CommunicationOptions(deterministic=True, bytes_per_pack=32)


def gradient(name: str, update: int, microbatch: int) -> np.ndarray:
    """Microbatch ``microbatch``'s gradient: wide exponents, so float sums depend on their order."""
    shape, dtype = SHAPES[name]
    rng = np.random.default_rng([list(SHAPES).index(name), update, microbatch])
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(-12, 12, shape)).astype(dtype)


def initial(name: str) -> np.ndarray:
    shape, dtype = SHAPES[name]
    return (1.0 + np.arange(math.prod(shape)).reshape(shape) / 16.0).astype(dtype)


def rounded(value: Fraction, dtype: type) -> np.floating:
    """``value`` rounded once to ``dtype``, to nearest, ties to even."""
    near = dtype(float(value))  # the float64 nearest, then its dtype neighbours: the nearest of them
    candidates = [near, np.nextafter(near, dtype(-np.inf)), np.nextafter(near, dtype(np.inf))]
    key = [
        (abs(Fraction(float(c)) - value), int(np.asarray(c).view(f"u{np.dtype(dtype).itemsize}")) & 1)
        for c in candidates
    ]
    return candidates[key.index(min(key))]


def exact_mean(name: str, update: int) -> np.ndarray:
    _, dtype = SHAPES[name]
    grads = [gradient(name, update, m) for m in range(M)]
    flat = [sum((Fraction(float(g.flat[i])) for g in grads), Fraction(0)) / M for i in range(grads[0].size)]
    return np.array([rounded(v, dtype) for v in flat], dtype=dtype).reshape(grads[0].shape)


def reference(kind: str, updates: int = UPDATES) -> dict[str, np.ndarray]:
    """The weights after ``updates`` updates, in NumPy, each from the exactly rounded mean gradient."""
    weights = {n: initial(n) for n in SHAPES}
    m = {n: np.zeros_like(w) for n, w in weights.items()}
    v = {n: np.zeros_like(w) for n, w in weights.items()}
    for u in range(updates):
        for n, w in weights.items():
            g = exact_mean(n, u)
            if kind == "sgd":
                g *= LR
                w -= g
                continue
            t = u + 1
            lr_t = LR * math.sqrt(1.0 - B2**t) / (1.0 - B1**t)
            m[n] *= B1
            g *= 1.0 - B1
            m[n] += g
            np.square(g, out=g)
            g *= (1.0 - B2) / (1.0 - B1) ** 2
            v[n] *= B2
            v[n] += g
            np.sqrt(v[n], out=g)
            g += EPS
            np.divide(m[n], g, out=g)
            g *= lr_t
            w -= g
    return weights


def make(strategy, kind: str, shard: bool):
    """The variables, and an optimizer accumulating K = M / R calls per update."""
    k = M // strategy.num_replicas_in_sync
    with strategy.scope():
        variables = {n: mpistrat.Variable(initial(n), name=n) for n in SHAPES}
        options = {"shard_state": shard, "communication_options": EXACT, "gradient_accumulation_steps": k}
        opt = SGD(LR, **options) if kind == "sgd" else Adam(LR, B1, B2, EPS, **options)
    return variables, opt


def train(strategy, variables, opt, updates: range) -> None:
    size, rank = strategy.num_replicas_in_sync, strategy.extended.rank
    k = M // size
    for u in updates:
        for m in range(rank * k, (rank + 1) * k):
            pairs = [(gradient(n, u, m) / size, variables[n]) for n in SHAPES]
            strategy.run(lambda pairs=pairs: opt.apply_gradients(pairs))


def mismatches(variables, want) -> list[str]:
    return [n for n, w in want.items() if variables[n].numpy().tobytes() != w.tobytes()]


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_weights_are_the_exact_reference_at_any_rank_count(group, kind, shard):
    if M % group.size or group.size & (group.size - 1):
        pytest.skip(f"{group.size} ranks: the guarantee holds where 1/R scales exactly (R a power of two)")
    strategy = mpistrat.MPIStrategy(group.comm)
    variables, opt = make(strategy, kind, shard)
    train(strategy, variables, opt, range(UPDATES))
    bad = mismatches(variables, reference(kind))
    iterations = int(opt.iterations.numpy())
    strategy.experimental_finalize()
    all_ranks_agree(group.comm, not bad and iterations == UPDATES, f"R={group.size}: {bad}, {iterations}")


def test_plain_sums_are_not_the_same_bits_at_every_rank_count():
    """The claim above is not vacuous: without deterministic=True these gradients do give other
    bits than the exact reference (float sums in another order)."""
    means = {n: sum(gradient(n, 0, m) for m in range(M)) / M for n in SHAPES}
    exact = {n: exact_mean(n, 0) for n in SHAPES}
    assert any(means[n].tobytes() != exact[n].tobytes() for n in SHAPES)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_checkpoint_saved_at_one_rank_count_continues_at_another(tmp_path, kind):
    """The first update at R = 1 on every rank (each its own file), the second at the world's R
    from rank 0's file; and the other way round. Both are the reference's bits."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    if M % size or size & (size - 1):
        pytest.skip(f"{size} ranks: R must divide M = {M} and be a power of two")
    directory = WORLD.bcast(str(tmp_path) if rank == 0 else None)
    bad = []
    for first, second in ((MPI.COMM_SELF, WORLD), (WORLD, MPI.COMM_SELF)):
        a = mpistrat.MPIStrategy(first.Dup())
        variables, opt = make(a, kind, False)
        train(a, variables, opt, range(1))
        path = mpistrat.Checkpoint(model=variables, opt=opt).save(
            f"{directory}/{first.Get_size()}-{0 if first is WORLD else rank}/ckpt"
        )
        a.experimental_finalize()
        path = WORLD.bcast(path if rank == 0 else None)
        b = mpistrat.MPIStrategy(second.Dup())
        variables, opt = make(b, kind, False)
        mpistrat.Checkpoint(model=variables, opt=opt).restore(path).assert_consumed()
        train(b, variables, opt, range(1, 2))
        bad += [
            f"{first.Get_size()}->{second.Get_size()}: {n}" for n in mismatches(variables, reference(kind))
        ]
        b.experimental_finalize()
    all_ranks_agree(WORLD, not bad, "; ".join(bad))


# -- every optimizer and the base arguments that touch the step ----------------------------------

KERAS_KINDS = {
    "adamw": lambda **o: AdamW(LR, weight_decay=0.1, **o),
    "rmsprop": lambda **o: RMSprop(LR, momentum=0.5, centered=True, **o),
    "adagrad-clipvalue": lambda **o: Adagrad(LR, clipvalue=0.01, **o),
    "amsgrad-ema": lambda **o: Adam(LR, amsgrad=True, use_ema=True, ema_overwrite_frequency=2, **o),
    "sgd-clipnorm": lambda **o: SGD(LR, momentum=0.9, clipnorm=0.01, **o),
    "adam-global": lambda **o: Adam(LR, global_clipnorm=0.01, **o),
    "lamb": lambda **o: Lamb(LR, weight_decay=0.01, **o),
}


def _trained_bits(comm, kind: str, shard: bool) -> dict[str, bytes]:
    strategy = mpistrat.MPIStrategy(comm.Dup())
    k = M // strategy.num_replicas_in_sync
    with strategy.scope():
        variables = {n: mpistrat.Variable(initial(n), name=n) for n in SHAPES}
        opt = KERAS_KINDS[kind](shard_state=shard, communication_options=EXACT, gradient_accumulation_steps=k)
    opt.exclude_from_weight_decay(var_names=["b"])
    train(strategy, variables, opt, range(3))
    with strategy.scope():
        bits = {n: v.numpy().tobytes() for n, v in variables.items()}
        bits |= {
            f"{n}/{s}": opt.get_slot(v, s).numpy().tobytes()
            for n, v in variables.items()
            for s in opt.slot_names
        }
    strategy.experimental_finalize()
    return bits


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("kind", list(KERAS_KINDS))
def test_every_optimizer_gives_the_same_bits_at_any_rank_count(kind, shard):
    """Weights and slots after three updates at the world's R are the bits of the same run on one
    rank (each rank alone: COMM_SELF): clipping norms and trust ratios are exact sums too."""
    size = WORLD.Get_size()
    if M % size or size & (size - 1):
        pytest.skip(f"{size} ranks: R must divide M = {M} and be a power of two")
    alone = _trained_bits(MPI.COMM_SELF, kind, shard)
    together = _trained_bits(WORLD, kind, shard)
    bad = [n for n in alone if alone[n] != together[n]]
    all_ranks_agree(WORLD, not bad, f"{kind} at R={size}: {bad} differ from R=1")
