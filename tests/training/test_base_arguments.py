"""Keras's base arguments and the new optimizers across ranks: weights against serial NumPy of the
summed gradients, the bytes the norms add (counted), and bad arguments refused.

Rank r's gradient is ``(r + 1)`` times a pattern of multiples of 1/8 (``test_flat_optimizers``),
so every rank's gradient and their sum are exact in float32. The reference applies Keras's
formulas, written out here in float64, to that sum, one variable at a time.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

import mpistrat
from mpistrat import InvalidArgumentError
from mpistrat.optimizers import SGD, Adagrad, Adam, AdamW, Lamb, RMSprop, schedules
from tests.conftest import WORLD, all_ranks_agree, raises_on_every_rank
from tests.support.counting import CountingComm, Ledger
from tests.training.test_flat_optimizers import NAMES, SHAPES, initial, local_grad, summed_grad

STEPS = 4
LR = 0.05

# name -> (make the optimizer, the reference's settings)
CASES = {
    "sgd-clipnorm": (lambda s: SGD(LR, momentum=0.9, clipnorm=0.5, shard_state=s), {"clipnorm": 0.5}),
    "adam-global": (lambda s: Adam(LR, global_clipnorm=1.0, shard_state=s), {"global_clipnorm": 1.0}),
    "adamw-excluded": (lambda s: AdamW(LR, weight_decay=0.3, shard_state=s), {"weight_decay": 0.3}),
    "adamw-global-every": (  # every variable decays: the decay and the clip's scale ride in the update's pass
        lambda s: AdamW(LR, weight_decay=0.3, global_clipnorm=1.0, shard_state=s),
        {"weight_decay": 0.3, "global_clipnorm": 1.0, "every": True},
    ),
    "rmsprop-ema": (
        lambda s: RMSprop(LR, momentum=0.5, centered=True, use_ema=True, ema_momentum=0.7, shard_state=s),
        {"ema": 0.7},
    ),
    "adagrad-clipvalue": (lambda s: Adagrad(LR, clipvalue=0.6, shard_state=s), {"clipvalue": 0.6}),
    "lamb": (lambda s: Lamb(LR, shard_state=s), {}),
    "lamb-global-decay": (
        lambda s: Lamb(LR, global_clipnorm=2.0, weight_decay=0.1, shard_state=s),
        {"global_clipnorm": 2.0, "weight_decay": 0.1},
    ),
}
EXCLUDED = ("b", "s")  # variables named here keep their weights from decay (but for "every" cases)


def keras_step(kind: str, settings: dict, w: dict, slots: dict, grads: dict, t: int, decays: dict) -> None:
    """One step of Keras's arithmetic in float64 (``t`` counts from 0), in place."""
    grads = dict(grads)
    if "clipnorm" in settings:
        c = settings["clipnorm"]
        grads = {n: g * c / max(np.linalg.norm(g), c) for n, g in grads.items()}
    if "global_clipnorm" in settings:
        c, norm = settings["global_clipnorm"], math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
        grads = {n: g * min(1.0, c / norm) for n, g in grads.items()}
    if "clipvalue" in settings:
        grads = {n: np.clip(g, -settings["clipvalue"], settings["clipvalue"]) for n, g in grads.items()}
    for n, g in grads.items():
        if settings.get("weight_decay") and decays[n]:
            w[n] = w[n] - w[n] * settings["weight_decay"] * LR
        s, step = slots[n], t + 1
        if kind == "sgd":  # momentum 0.9
            s["momentum"] = 0.9 * s["momentum"] - LR * g
            w[n] = w[n] + s["momentum"]
        elif kind in ("adam", "adamw"):
            s["m"] = 0.9 * s["m"] + 0.1 * g
            s["v"] = 0.999 * s["v"] + 0.001 * g * g
            w[n] = w[n] - LR * math.sqrt(1 - 0.999**step) / (1 - 0.9**step) * s["m"] / (
                np.sqrt(s["v"]) + 1e-7
            )
        elif kind == "rmsprop":  # momentum 0.5, centered
            s["velocity"] = 0.9 * s["velocity"] + 0.1 * g * g
            s["average_gradient"] = 0.9 * s["average_gradient"] + 0.1 * g
            increment = LR * g / np.sqrt(s["velocity"] - s["average_gradient"] ** 2 + 1e-7)
            s["momentum"] = 0.5 * s["momentum"] + increment
            w[n] = w[n] - s["momentum"]
        elif kind == "adagrad":
            s["accumulator"] = s["accumulator"] + g * g
            w[n] = w[n] - LR * g / np.sqrt(s["accumulator"] + 1e-7)
        elif kind == "lamb":
            s["m"] = 0.9 * s["m"] + 0.1 * g
            s["v"] = 0.999 * s["v"] + 0.001 * g * g
            u = (s["m"] / (1 - 0.9**step)) / (np.sqrt(s["v"] / (1 - 0.999**step)) + 1e-7)
            w_norm, u_norm = np.linalg.norm(w[n]), np.linalg.norm(u)
            ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            w[n] = w[n] - ratio * LR * u
        if "ema" in settings:
            m = 0.0 if t == 0 else settings["ema"]
            s["average"] = m * s["average"] + (1 - m) * w[n]


def reference(case: str, size: int) -> tuple[dict, dict]:
    kind, settings = case.split("-")[0], CASES[case][1]
    slot_names = {
        "sgd": ["momentum"],
        "adam": ["m", "v"],
        "adamw": ["m", "v"],
        "rmsprop": ["velocity", "momentum", "average_gradient"],
        "adagrad": ["accumulator"],
        "lamb": ["m", "v"],
    }[kind] + (["average"] if "ema" in settings else [])
    w = {n: initial(n).astype(np.float64) for n in NAMES}
    start = {"accumulator": 0.1}
    slots = {n: {s: np.full_like(w[n], start.get(s, 0.0)) for s in slot_names} for n in NAMES}
    decays = {n: settings.get("every") or n not in EXCLUDED for n in NAMES}
    for t in range(STEPS):
        keras_step(kind, settings, w, slots, {n: summed_grad(n, t, size) for n in NAMES}, t, decays)
    return w, {f"{n}/{s}": v for n, d in slots.items() for s, v in d.items()}


def train(strategy, case: str, shard: bool, rank: int, stream: bool = False):
    with strategy.scope():
        variables = {n: mpistrat.Variable(initial(n), name=n) for n in NAMES}
        opt = CASES[case][0](shard)
    if opt.weight_decay and not CASES[case][1].get("every"):
        opt.exclude_from_weight_decay([variables[n] for n in EXCLUDED])
    for t in range(STEPS):
        pairs = [(local_grad(n, t, rank), variables[n]) for n in NAMES]
        if stream and t > 0:  # a generator, last variable first: its sums overlap (the first step builds)
            strategy.run(lambda pairs=pairs: opt.apply_gradients(p for p in reversed(pairs)))
        else:
            strategy.run(lambda pairs=pairs: opt.apply_gradients(pairs))
    with strategy.scope():
        weights = {n: v.numpy() for n, v in variables.items()}
        slots = {f"{n}/{s}": opt.get_slot(v, s).numpy() for n, v in variables.items() for s in opt.slot_names}
    return weights, slots


def close(got: dict, want: dict) -> list[str]:
    bad = []
    for name, expected in want.items():
        value = got[name]
        dtype = SHAPES[name.split("/")[0]][1]
        tol = {"rtol": 2e-5, "atol": 1e-6} if dtype == np.float32 else {"rtol": 1e-10, "atol": 1e-12}
        if value.dtype != dtype or not np.allclose(value, expected, **tol):
            bad.append(f"{name}: {value.ravel()[:4]} vs {np.ravel(expected)[:4]}")
    return bad


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("case", list(CASES))
def test_weights_match_numpy_of_the_summed_gradients(group, case, shard):
    strategy = mpistrat.MPIStrategy(group.comm, communication_options=mpistrat.CommunicationOptions(32))
    weights, slots = train(strategy, case, shard, group.rank)
    strategy.experimental_finalize()
    ref_weights, ref_slots = reference(case, group.size)
    bad = close(weights, ref_weights) + close(slots, ref_slots)
    all_ranks_agree(group.comm, not bad, f"{case}: " + "; ".join(bad))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("case", ["lamb-global-decay", "rmsprop-ema"])
def test_a_generator_of_pairs_gives_the_same_weights(group, case, shard):
    """The streamed step (a generator: each pack's sum starts as its gradients come) waits for
    every sum before norms over whole variables, then updates as the list step does."""
    strategy = mpistrat.MPIStrategy(group.comm, communication_options=mpistrat.CommunicationOptions(32))
    weights, slots = train(strategy, case, shard, group.rank, stream=True)
    strategy.experimental_finalize()
    ref_weights, ref_slots = reference(case, group.size)
    bad = close(weights, ref_weights) + close(slots, ref_slots)
    all_ranks_agree(group.comm, not bad, f"{case}: " + "; ".join(bad))


# -- counted: the norms' bytes per step do not grow with the ranks ------------------------------


def _counted_step(comm, make, rank: int, n_vars: int) -> list[tuple[str, int]]:
    """(call, bytes sent) of one step after the first, on this rank."""
    counting = CountingComm(comm)
    strategy = mpistrat.MPIStrategy(counting)
    with strategy.scope():
        variables = [
            mpistrat.Variable(np.ones(1000 + 37 * i, np.float32), name=f"v{i}") for i in range(n_vars)
        ]
        opt = make()
    pairs = [(np.full(v.shape, rank + 1.0, np.float32), v) for v in variables]
    strategy.run(lambda: opt.apply_gradients(pairs))  # builds
    with Ledger.recording() as ledger:
        strategy.run(lambda: opt.apply_gradients(pairs))
    strategy.experimental_finalize()
    return [(c.name, c.sent) for c in ledger.log]


def _extra(plain: list, other: list) -> list:
    """The calls ``other`` makes beyond those of ``plain``."""
    left = list(plain)
    out = []
    for call in other:
        if call in left:
            left.remove(call)
        else:
            out.append(call)
    return out


@pytest.mark.skipif(WORLD.Get_size() < 2, reason="counts what ranks send each other")
def test_norms_add_one_small_allreduce_whose_bytes_do_not_grow_with_the_ranks():
    """Sharded: ``global_clipnorm`` adds one all-reduce of one float64 (the partial sum of squares),
    ``clipnorm`` one of a float64 per variable, LAMB one of two per variable: the same at any rank
    count, and never a gather of gradients."""
    comm, n_vars = WORLD.Dup(), 5
    plain = _counted_step(comm, lambda: Adam(0.1, shard_state=True), comm.rank, n_vars)
    clipped = _counted_step(comm, lambda: Adam(0.1, global_clipnorm=1.0, shard_state=True), comm.rank, n_vars)
    per_var = _counted_step(comm, lambda: Adam(0.1, clipnorm=1.0, shard_state=True), comm.rank, n_vars)
    lamb = _counted_step(comm, lambda: Lamb(0.1, shard_state=True), comm.rank, n_vars)
    got = {
        "global_clipnorm": _extra(plain, clipped),
        "clipnorm": _extra(plain, per_var),
        "lamb": _extra(plain, lamb),
    }
    want = {
        "global_clipnorm": [("Allreduce", 8)],
        "clipnorm": [("Allreduce", 8 * n_vars)],
        "lamb": [("Allreduce", 16 * n_vars)],
    }
    all_ranks_agree(comm, got == want, f"added {got}; expected {want}; a plain step {plain}")
    comm.Free()


# -- bad arguments: a clear error, on every rank, before anything is written -----------------------


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SGD(0.1, weight_decay=-0.1), "weight_decay must be a number >= 0 or None; got -0.1"),
        (
            lambda: Adam(clipnorm=1.0, global_clipnorm=1.0),
            "only one of clipnorm, clipvalue and global_clipnorm",
        ),
        (lambda: Adam(clipnorm=0.0), "clipnorm must be a number > 0 or None; got 0.0"),
        (lambda: Adam(use_ema=True, ema_momentum=1.5), r"ema_momentum must be in \[0, 1\]; got 1.5"),
        (lambda: Adam(ema_overwrite_frequency=0), "ema_overwrite_frequency must be an integer >= 1"),
        (lambda: RMSprop(rho=1.5), r"rho must be in \[0, 1\]; got 1.5"),
        (lambda: Adagrad(initial_accumulator_value=-1.0), "initial_accumulator_value must be a number >= 0"),
        (lambda: Lamb(epsilon=0.0), "epsilon must be a number > 0; got 0.0"),
        (lambda: schedules.ExponentialDecay(0.1, 10, decay_rate=-0.5), "decay_rate must be a number >= 0.0"),
        (lambda: AdamW(weight_decay=None), "weight_decay must be a number >= 0"),
        (lambda: Adam(0.1, 0.9, 0.999, 1e-7, "mine"), "amsgrad must be True or False; got 'mine'"),
    ],
)
def test_a_bad_argument_is_refused_when_made(make, match):
    with pytest.raises(InvalidArgumentError, match=match):
        make()


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_a_schedule_returning_nan_writes_nothing_on_any_rank(group, shard):
    with group.strategy.scope():
        w = mpistrat.Variable(np.arange(4.0), name="w")
        opt = Lamb(
            lambda step: 0.1 if step == 0 else math.nan, global_clipnorm=1.0, use_ema=True, shard_state=shard
        )
    group.strategy.run(lambda: opt.apply_gradients([(np.ones(4), w)]))
    with group.strategy.scope():
        before = (w.numpy(), opt.get_slot(w, "m").numpy(), opt.get_slot(w, "average").numpy())
    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: group.strategy.run(lambda: opt.apply_gradients([(np.ones(4), w)])),
        "learning_rate at step 1 must be a finite number",
    )
    with group.strategy.scope():
        after = (w.numpy(), opt.get_slot(w, "m").numpy(), opt.get_slot(w, "average").numpy())
    same = all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    all_ranks_agree(group.comm, same and int(opt.iterations.numpy()) == 1, f"{before} -> {after}")


def test_ranks_that_exclude_different_variables_from_decay_fail_at_build(world):
    if world.size == 1:
        pytest.skip("needs two ranks")
    with world.strategy.scope():
        w = mpistrat.Variable(np.ones(3), name="w")
        b = mpistrat.Variable(np.ones(2), name="b")
        opt = AdamW(0.1)
    opt.exclude_from_weight_decay(var_names=["b"] if world.rank == 0 else [])
    raises_on_every_rank(
        world.comm,
        mpistrat.CollectiveMismatchError,
        lambda: world.strategy.run(lambda: opt.apply_gradients([(np.ones(3), w), (np.ones(2), b)])),
        "no weight decay",
    )


# -- a checkpoint saved with one setting restores at another rank count ---------------------------


def _lamb(shard: bool):
    return Lamb(LR, global_clipnorm=2.0, use_ema=True, ema_momentum=0.5, shard_state=shard)


def test_a_checkpoint_of_a_sharded_optimizer_restores_unsharded_on_one_rank(world, tmp_path):
    directory = world.comm.bcast(str(tmp_path) if world.rank == 0 else None)
    with world.strategy.scope():
        variables = {n: mpistrat.Variable(initial(n), name=n) for n in NAMES}
        opt = _lamb(shard=True)
    opt.learning_rate = 0.03
    for t in range(3):
        pairs = [(local_grad(n, t, world.rank), variables[n]) for n in NAMES]
        world.strategy.run(lambda pairs=pairs: opt.apply_gradients(pairs))
    path = mpistrat.Checkpoint(model=variables, opt=opt).save(os.path.join(directory, "ckpt"))
    pairs = [(local_grad(n, 3, world.rank), variables[n]) for n in NAMES]
    world.strategy.run(lambda: opt.apply_gradients(pairs))  # the step both sides take next
    with world.strategy.scope():
        want = {n: v.numpy() for n, v in variables.items()}
        want |= {f"{n}/{s}": opt.get_slot(v, s).numpy() for n, v in variables.items() for s in opt.slot_names}
    alone = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF.Dup())  # every rank by itself: one rank
    with alone.scope():
        restored = {n: mpistrat.Variable(np.zeros_like(initial(n)), name=n) for n in NAMES}
        again = _lamb(shard=False)
    mpistrat.Checkpoint(model=restored, opt=again).restore(path).assert_consumed()
    ok = float(again.learning_rate) == 0.03 and int(again.iterations.numpy()) == 3
    summed = [(summed_grad(n, 3, world.size).astype(SHAPES[n][1]), restored[n]) for n in NAMES]
    alone.run(lambda: again.apply_gradients(summed))
    with alone.scope():
        got = {n: v.numpy() for n, v in restored.items()}
        got |= {
            f"{n}/{s}": again.get_slot(v, s).numpy() for n, v in restored.items() for s in again.slot_names
        }
    alone.experimental_finalize()
    bad = close(got, want)
    all_ranks_agree(world.comm, ok and not bad, f"{again.learning_rate} {again.iterations.numpy()} {bad}")


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("stream", [False, True], ids=["list", "generator"])
def test_ranks_with_different_base_arguments_fail_every_rank_and_write_nothing(world, shard, stream):
    """One rank clips by the global norm and the others do not: that rank's step would make one more
    all-reduce. The step's handshake compares the arguments first."""
    if world.size == 1:
        pytest.skip("needs two ranks")
    last = world.rank == world.size - 1
    with world.strategy.scope():
        w = mpistrat.Variable(np.arange(6.0), name="w")
        opt = Adam(0.1, shard_state=shard, **({"global_clipnorm": 1.0} if last else {}))
    opt.build([w])  # the same variables: the build agrees
    raises_on_every_rank(
        world.comm,
        mpistrat.CollectiveMismatchError,
        lambda: world.strategy.run(
            lambda: opt.apply_gradients((p for p in [(np.ones(6), w)]) if stream else [(np.ones(6), w)])
        ),
        "base arguments",
    )
    all_ranks_agree(world.comm, np.array_equal(w.numpy(), np.arange(6.0)), f"written: {w.numpy()}")


def test_ranks_with_different_optimizers_fail_at_build(world):
    if world.size == 1:
        pytest.skip("needs two ranks")
    with world.strategy.scope():
        w = mpistrat.Variable(np.ones(3), name="w")
        opt = AdamW(0.1) if world.rank == 0 else Adam(0.1)
    raises_on_every_rank(
        world.comm,
        mpistrat.CollectiveMismatchError,
        lambda: world.strategy.run(lambda: opt.apply_gradients([(np.ones(3), w)])),
        "AdamW",  # its step counter's name already differs from Adam's
    )
