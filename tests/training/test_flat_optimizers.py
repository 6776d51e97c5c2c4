"""Flat optimizers: SGD and Adam on flat per-dtype buffers, with and without ``shard_state``.

Rank r's gradient is ``(r + 1)`` times a pattern every rank knows, so the summed gradient the
optimizer must apply is known on every rank. The expected values come from a serial float64
NumPy reference written out here from the textbook formulas (Adam in the bias-corrected
m-hat / v-hat form, tf's epsilon added to the uncorrected sqrt(v): eps / sqrt(1 - b2^t) here),
applied to that sum, never from the code under test. The patterns are multiples of 1/8, so
every rank's gradient and their sum are exact in float32 and only the update rounds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import mpistrat
from mpistrat import CollectiveMismatchError, CommunicationOptions, InvalidArgumentError, MpistratError
from mpistrat.optimizers import SGD, Adam
from mpistrat.training.sharded_slot import ShardedSlot
from tests.conftest import all_ranks_agree, raises_on_every_rank

LR, MOMENTUM = 0.1, 0.9
B1, B2, EPS = 0.9, 0.999, 1e-7
STEPS = 5
PACK = 32  # bytes: 8 float32 or 4 float64 elements, so several packs per dtype at 1 to 4 ranks

# Several shapes (a scalar, 1-D, 2-D) in two dtypes, all in one optimizer.
SHAPES = {
    "w": ((4, 5), np.float32),
    "b": ((6,), np.float32),
    "s": ((), np.float32),
    "d": ((3, 3), np.float64),
    "e": ((2,), np.float64),
}
NAMES = list(SHAPES)

KINDS = ["sgd", "momentum", "nesterov", "adam"]
SLOTS = {"sgd": (), "momentum": ("momentum",), "nesterov": ("momentum",), "adam": ("m", "v")}

# The tolerance of each dtype: float32's rounding over a few steps; float64's (so a float64 variable
# updated in float32 would fail).
TOL = {
    np.dtype(np.float32): {"rtol": 1e-5, "atol": 1e-6},
    np.dtype(np.float64): {"rtol": 1e-10, "atol": 1e-12},
}
# Sharded against unsharded: the same arithmetic on the same summed gradient, so at most rounding.
ROUNDING = {
    np.dtype(np.float32): {"rtol": 1e-6, "atol": 1e-7},
    np.dtype(np.float64): {"rtol": 1e-14, "atol": 1e-15},
}


def make_optimizer(kind: str, shard: bool):
    if kind == "sgd":
        return SGD(LR, shard_state=shard)
    if kind == "momentum":
        return SGD(LR, momentum=MOMENTUM, shard_state=shard)
    if kind == "nesterov":
        return SGD(LR, momentum=MOMENTUM, nesterov=True, shard_state=shard)
    return Adam(LR, beta_1=B1, beta_2=B2, epsilon=EPS, shard_state=shard)


def initial(name: str) -> np.ndarray:
    shape, dtype = SHAPES[name]
    k = NAMES.index(name)
    return (1.0 + 0.5 * k + np.arange(math.prod(shape)).reshape(shape) / 8.0).astype(dtype)


def pattern(name: str, step: int) -> np.ndarray:
    """This step's gradient pattern for ``name``: multiples of 1/8 in [-1, 1] (float64)."""
    shape, _ = SHAPES[name]
    rng = np.random.default_rng([NAMES.index(name), step])
    return np.asarray(rng.integers(-8, 9, size=shape) / 8.0, dtype=np.float64).reshape(shape)


def local_grad(name: str, step: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s gradient, in its variable's dtype."""
    return np.asarray((rank + 1) * pattern(name, step), dtype=SHAPES[name][1])


def summed_grad(name: str, step: int, size: int) -> np.ndarray:
    """The sum over the ``size`` ranks of their gradients (float64)."""
    return sum((r + 1) * pattern(name, step) for r in range(size))


class Reference:
    """Serial float64 NumPy: the textbook update of each variable given, from the summed gradient."""

    def __init__(self, kind: str, names: list[str] = NAMES):
        self.kind = kind
        self.params = {n: initial(n).astype(np.float64) for n in names}
        self.slots = {n: {s: np.zeros_like(p) for s in SLOTS[kind]} for n, p in self.params.items()}
        self.t = 0  # steps applied: one counter for every variable (the optimizer's iterations)

    def step(self, grads: dict[str, np.ndarray], lr: float = LR) -> None:
        """One step; variables left out of ``grads`` (a None gradient) and their slots stay as they are."""
        t = self.t + 1
        for name, g in grads.items():
            p, s = self.params[name], self.slots[name]
            if self.kind == "sgd":
                p = p - lr * g
            elif self.kind in ("momentum", "nesterov"):
                s["momentum"] = MOMENTUM * s["momentum"] - lr * g
                p = p + (MOMENTUM * s["momentum"] - lr * g if self.kind == "nesterov" else s["momentum"])
            else:
                s["m"] = B1 * s["m"] + (1 - B1) * g
                s["v"] = B2 * s["v"] + (1 - B2) * g * g
                m_hat, v_hat = s["m"] / (1 - B1**t), s["v"] / (1 - B2**t)
                p = p - lr * m_hat / (np.sqrt(v_hat) + EPS / math.sqrt(1 - B2**t))
            self.params[name] = p
        self.t += 1


@pytest.fixture(params=[0, PACK], ids=["one-pack", "packs"])
def strategy(group, request):
    """A strategy over ``group``'s ranks whose flat buffers are cut into packs of ``bytes_per_pack``."""
    made = mpistrat.MPIStrategy(
        group.comm, communication_options=CommunicationOptions(bytes_per_pack=request.param)
    )
    yield made
    made.experimental_finalize()


def make_variables(strategy, names: list[str] = NAMES) -> dict[str, mpistrat.Variable]:
    with strategy.scope():
        return {n: mpistrat.Variable(initial(n), name=n) for n in names}


def run_step(strategy, opt, pairs) -> None:
    strategy.run(lambda: opt.apply_gradients(pairs))


def train(group, strategy, kind: str, shard: bool, steps: int = STEPS):
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make_optimizer(kind, shard)
    for t in range(steps):
        run_step(strategy, opt, [(local_grad(n, t, group.rank), variables[n]) for n in NAMES])
    return variables, opt


def reference_after(kind: str, size: int, steps: int = STEPS) -> Reference:
    ref = Reference(kind)
    for t in range(steps):
        ref.step({n: summed_grad(n, t, size) for n in NAMES})
    return ref


def differences(got: dict[str, np.ndarray], want: dict[str, np.ndarray], tol=TOL) -> list[str]:
    """What differs: a dtype, a shape, or values beyond the dtype's tolerance."""
    out = []
    for name, expected in want.items():
        value, dtype = np.asarray(got[name]), np.dtype(SHAPES[name.split("/")[0]][1])
        if value.dtype != dtype or value.shape != expected.shape:
            out.append(f"{name}: {value.dtype}{list(value.shape)}, expected {dtype}{list(expected.shape)}")
        elif not np.allclose(value, expected, **tol[dtype]):
            out.append(f"{name}: {value.tolist()} vs {np.asarray(expected).tolist()}")
    return out


def weights(variables) -> dict[str, np.ndarray]:
    return {n: v.numpy() for n, v in variables.items()}


def slots(opt, variables, kind: str) -> dict[str, np.ndarray]:
    """Every slot as ``name/slot``: collective for a sharded optimizer (every rank calls it)."""
    return {f"{n}/{s}": opt.get_slot(v, s).numpy() for n, v in variables.items() for s in SLOTS[kind]}


def reference_slots(ref: Reference) -> dict[str, np.ndarray]:
    return {f"{n}/{s}": value for n, slots in ref.slots.items() for s, value in slots.items()}


def same_bytes_on_every_rank(comm, arrays: dict[str, np.ndarray]) -> bool:
    mine = {n: (a.dtype.str, a.shape, a.tobytes()) for n, a in arrays.items()}
    return all(theirs == mine for theirs in comm.allgather(mine))


# -- 1, 2: the update rules, sharded or not, in one pack or several, shapes and dtypes -----------


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("kind", KINDS)
def test_steps_match_numpy(group, strategy, kind, shard):
    variables, opt = train(group, strategy, kind, shard)
    ref = reference_after(kind, group.size)
    got = weights(variables)
    bad = differences(got, ref.params)
    got_slots = slots(opt, variables, kind)
    bad += differences(got_slots, reference_slots(ref))
    kinds = {type(opt.get_slot(v, s)) for v in variables.values() for s in SLOTS[kind]}
    if kinds and kinds != {ShardedSlot if shard else mpistrat.MirroredVariable}:
        bad.append(f"slots are {kinds}")
    if int(opt.iterations.numpy()) != STEPS or opt.shard_state != shard:
        bad.append(f"iterations {opt.iterations.numpy()}, shard_state {opt.shard_state}")
    if not same_bytes_on_every_rank(group.comm, {**got, **got_slots}):
        bad.append("the copies differ between ranks")
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_equals_replicated(group, strategy, kind):
    replicated, plain = train(group, strategy, kind, shard=False)
    sharded, zero = train(group, strategy, kind, shard=True)
    bad = differences(weights(sharded), weights(replicated), ROUNDING)
    bad += differences(slots(zero, sharded, kind), slots(plain, replicated, kind), ROUNDING)
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


def test_gradients_of_another_float_dtype_are_cast(group, strategy):
    """float64 gradients for float32 variables, a Python float for a scalar: the same step."""
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make_optimizer("adam", shard=True)
    ref = Reference("adam")
    for t in range(2):
        pairs = []
        for n in NAMES:
            g = (group.rank + 1) * pattern(n, t)
            pairs.append((float(g) if n == "s" else g.astype(np.float64), variables[n]))
        run_step(strategy, opt, pairs)
        ref.step({n: summed_grad(n, t, group.size) for n in NAMES})
    bad = differences(weights(variables), ref.params)
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_groups_smaller_than_the_ranks(group, strategy, shard):
    """One float32 element and two float64 ones: at 3 and 4 ranks some ranks own only padding."""
    names = ["s", "e"]
    variables = make_variables(strategy, names)
    with strategy.scope():
        opt = make_optimizer("adam", shard)
    ref = Reference("adam", names)
    for t in range(STEPS):
        run_step(strategy, opt, [(local_grad(n, t, group.rank), variables[n]) for n in names])
        ref.step({n: summed_grad(n, t, group.size) for n in names})
    got = weights(variables)
    bad = differences(got, ref.params) + differences(slots(opt, variables, "adam"), reference_slots(ref))
    if not same_bytes_on_every_rank(group.comm, got):
        bad.append("the copies differ between ranks")
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("alone", [True, False], ids=["alone-in-its-dtype", "beside-others"])
def test_a_variable_with_no_elements(group, strategy, kind, shard, alone):
    """An empty variable (shape (0,), e.g. an unused bias) is updated as the others: it stays empty.
    Alone in its dtype it makes a group of no elements."""
    names = ["e"] if alone else ["b", "e"]  # float64; the empty one is float32
    variables = make_variables(strategy, names)
    with strategy.scope():
        empty = mpistrat.Variable(np.zeros((0,), np.float32), name="empty")
        opt = make_optimizer(kind, shard)
    ref = Reference(kind, names)
    bad = []
    try:
        for t in range(2):
            pairs = [(local_grad(n, t, group.rank), variables[n]) for n in names]
            run_step(strategy, opt, [(np.zeros((0,), np.float32), empty), *pairs])
            ref.step({n: summed_grad(n, t, group.size) for n in names})
    except Exception as exc:  # on every rank alike: report it through all_ranks_agree
        bad.append(f"{type(exc).__name__}: {exc}")
    bad += differences(weights(variables), ref.params)
    if empty.shape != (0,) or empty.dtype != np.float32:
        bad.append(f"the empty variable is now {empty.dtype}{empty.shape}")
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


def test_default_strategy_plain_variables():
    """Outside any strategy: plain variables, one replica; shard_state=True holds all of each slot."""
    for shard in (False, True):
        variables = {n: mpistrat.Variable(initial(n), name=n) for n in NAMES}
        opt = make_optimizer("adam", shard)
        for t in range(STEPS):
            opt.apply_gradients([(local_grad(n, t, 0), variables[n]) for n in NAMES])
        ref = reference_after("adam", size=1)
        bad = differences(weights(variables), ref.params)
        bad += differences(slots(opt, variables, "adam"), reference_slots(ref))
        assert not bad, f"shard_state={shard}: " + "; ".join(bad)


# -- 3: None gradients, order, variables seen later ---------------------------------------------

NONE_AT = {1: {"b", "s"}, 2: {"d"}, 3: {"b"}}  # step -> variables whose gradient is None that step


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_a_none_gradient_leaves_its_variable_and_slots_as_they_are(group, strategy, kind, shard):
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make_optimizer(kind, shard)
    ref = Reference(kind)
    bad = []
    for t in range(STEPS):
        skipped = NONE_AT.get(t, set())
        before, slots_before = weights(variables), slots(opt, variables, kind) if t else {}
        pairs = [(None if n in skipped else local_grad(n, t, group.rank), variables[n]) for n in NAMES]
        run_step(strategy, opt, pairs)
        ref.step({n: summed_grad(n, t, group.size) for n in NAMES if n not in skipped})
        after, slots_after = weights(variables), slots(opt, variables, kind)
        for n in skipped:
            if after[n].tobytes() != before[n].tobytes():
                bad.append(f"step {t}: {n} moved without a gradient")
            for s in SLOTS[kind]:
                if slots_after[f"{n}/{s}"].tobytes() != slots_before[f"{n}/{s}"].tobytes():
                    bad.append(f"step {t}: slot {n}/{s} moved without a gradient")
        bad += [f"step {t}: {d}" for d in differences(after, ref.params)]
        bad += [f"step {t}: {d}" for d in differences(slots_after, reference_slots(ref))]
    if not same_bytes_on_every_rank(group.comm, weights(variables)):
        bad.append("the copies differ between ranks")
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("kind", ["nesterov", "adam"])
def test_pairs_in_a_different_order_on_each_rank(group, strategy, kind, shard):
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make_optimizer(kind, shard)
    shift = group.rank % len(NAMES)
    order = NAMES[shift:] + NAMES[:shift]
    if group.rank % 2:
        order.reverse()
    for t in range(STEPS):
        skipped = NONE_AT.get(t, set())  # a subset too, given in this rank's order
        run_step(
            strategy, opt, [(local_grad(n, t, group.rank), variables[n]) for n in order if n not in skipped]
        )
    ref = Reference(kind)
    for t in range(STEPS):
        ref.step({n: summed_grad(n, t, group.size) for n in NAMES if n not in NONE_AT.get(t, set())})
    got = weights(variables)
    bad = differences(got, ref.params) + differences(slots(opt, variables, kind), reference_slots(ref))
    if not same_bytes_on_every_rank(group.comm, got):
        bad.append("the copies differ between ranks")
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_a_variable_first_given_later_is_built_then(group, strategy, kind, shard):
    """Step 0 updates w and s; d and b join at step 1, e at step 3 (Adam's t counts every step)."""
    joins = {"w": 0, "s": 0, "d": 1, "b": 1, "e": 3}
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make_optimizer(kind, shard)
    ref = Reference(kind)
    bad = []
    nbytes = [opt.state_nbytes()]
    for t in range(STEPS):
        given = [n for n in NAMES if joins[n] <= t]
        if t == 0:
            with pytest.raises(InvalidArgumentError, match="no slot"):
                opt.get_slot(variables["d"], SLOTS[kind][0])
        run_step(strategy, opt, [(local_grad(n, t, group.rank), variables[n]) for n in given])
        ref.step({n: summed_grad(n, t, group.size) for n in given})
        nbytes.append(opt.state_nbytes())
    if not nbytes[0] < nbytes[1] < nbytes[2] == nbytes[3] < nbytes[4] == nbytes[5]:
        bad.append(f"state_nbytes over the steps: {nbytes}")
    got = weights(variables)
    bad += differences(got, ref.params) + differences(slots(opt, variables, kind), reference_slots(ref))
    if len(opt.variables()) != 2 + len(NAMES) * len(SLOTS[kind]):  # iterations, learning_rate, slots
        bad.append(f"variables(): {opt.variables()}")
    if not same_bytes_on_every_rank(group.comm, got):
        bad.append("the copies differ between ranks")
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


# -- 4: copy-on-write and assign --------------------------------------------------------------


READS = {  # each read held alone across a step, so that one kind of hold is never covered by another
    "value": lambda v, opt: v["w"].value(),
    "slice": lambda v, opt: v["w"].value()[1:],
    "asarray": lambda v, opt: np.asarray(v["w"]),
    "memoryview": lambda v, opt: memoryview(v["w"].value()),
    "scalar": lambda v, opt: v["s"].value(),
    "float64-slice": lambda v, opt: np.asarray(v["d"])[::2],
    "slot": lambda v, opt: opt.get_slot(v["w"], "m").value(),  # collective when sharded
}


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("read", list(READS))
def test_a_value_read_before_a_step_keeps_its_contents(group, strategy, read, shard):
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make_optimizer("adam", shard)
    ref = Reference("adam")
    bad = []
    for t in range(3):  # before the first step (nothing built yet) and before later ones
        held = READS[read](variables, opt) if read != "slot" or t else None
        kept = None if held is None else bytes(held) if read == "memoryview" else np.array(held, copy=True)
        before = weights(variables)
        run_step(strategy, opt, [(local_grad(n, t, group.rank), variables[n]) for n in NAMES])
        ref.step({n: summed_grad(n, t, group.size) for n in NAMES})
        if read == "memoryview" and bytes(held) != kept:
            bad.append(f"step {t}: the memoryview read before the step changed")
        elif read != "memoryview" and held is not None and np.asarray(held).tobytes() != kept.tobytes():
            bad.append(f"step {t}: the {read} read before the step is now {held}, was {kept}")
        if np.array_equal(variables["w"].numpy(), before["w"]):
            bad.append(f"step {t}: w did not move")
        bad += [f"step {t}: {x}" for x in differences(weights(variables), ref.params)]
        bad += [f"step {t}: {x}" for x in differences(slots(opt, variables, "adam"), reference_slots(ref))]
        del held
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_an_assign_between_steps_is_where_the_next_step_starts(group, strategy, kind, shard):
    """An assign with nothing holding the value (written in place into the flat buffer) and one with
    the old value held (the variable gets a new array): either way the next step starts from it,
    and the slots carry on."""
    variables = make_variables(strategy)
    w, s, e = variables["w"], variables["s"], variables["e"]
    with strategy.scope():
        opt = make_optimizer(kind, shard)
    ref = Reference(kind)
    bad = []

    def step(t):
        run_step(strategy, opt, [(local_grad(n, t, group.rank), variables[n]) for n in NAMES])
        ref.step({n: summed_grad(n, t, group.size) for n in NAMES})

    step(0)
    x = np.full((4, 5), -2.5, np.float32)
    with strategy.scope():
        w.assign(x)
        s.assign(np.float32(7.0))
    ref.params["w"], ref.params["s"] = x.astype(np.float64), np.float64(7.0)
    if not (np.array_equal(w.numpy(), x) and float(s.numpy()) == 7.0):
        bad.append(f"after assign: {w.numpy()} {s.numpy()}")
    step(1)
    held = [w.value(), e.value()]
    x2 = np.arange(20, dtype=np.float32).reshape(4, 5) / 4.0
    with strategy.scope():
        w.assign(x2)
        e.assign_add(np.array([1.0, -1.0]))
    ref.params["w"], ref.params["e"] = x2.astype(np.float64), ref.params["e"] + np.array([1.0, -1.0])
    step(2)
    del held
    step(3)
    got = weights(variables)
    bad += differences(got, ref.params) + differences(slots(opt, variables, kind), reference_slots(ref))
    if not same_bytes_on_every_rank(group.comm, got):
        bad.append("the copies differ between ranks")
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("how", ["assign", "assign_add"])
def test_a_value_held_across_a_write_keeps_it_after_the_next_step(group, strategy, how, shard):
    """``a = w.value()``, then a write (which leaves ``a`` alone, giving ``w`` a new array), then a
    step (which copies that array back into the flat buffer): ``a`` must still hold what it read."""
    variables = make_variables(strategy)
    w = variables["w"]
    with strategy.scope():
        opt = make_optimizer("sgd", shard)
    ref = Reference("sgd")
    bad = []
    for t in range(2):  # the first step builds the flat buffer; the second writes into it
        held = w.value()
        before = held.copy()
        delta = np.full((4, 5), 0.5, np.float32)
        with strategy.scope():
            getattr(w, how)(delta)
        ref.params["w"] = delta.astype(np.float64) if how == "assign" else ref.params["w"] + delta
        if held.tobytes() != before.tobytes():
            bad.append(f"step {t}: the {how} changed the value read before it")
        run_step(strategy, opt, [(local_grad(n, t, group.rank), variables[n]) for n in NAMES])
        ref.step({n: summed_grad(n, t, group.size) for n in NAMES})
        if held.tobytes() != before.tobytes():
            bad.append(
                f"step {t}: the value read before the {how} is now {held.tolist()}, was {before.tolist()}"
            )
        bad += [f"step {t}: {d}" for d in differences(weights(variables), ref.params)]
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


# -- 5: bad input raises on every rank -------------------------------------------------------


def unchanged(variables, opt, kind, want_weights, want_slots) -> list[str]:
    """Differences from the reference (its steps only: the bad calls moved nothing)."""
    return differences(weights(variables), want_weights) + differences(
        slots(opt, variables, kind), want_slots
    )


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize(
    "gradient",
    [
        lambda: np.float32(1.0),  # NumPy would broadcast it
        lambda: np.ones((5, 4), np.float32),  # as many elements, another shape
        lambda: np.ones(20, np.float32),
        lambda: np.ones((1, 5), np.float32),  # broadcastable
    ],
    ids=["scalar", "transposed", "flattened", "row"],
)
def test_a_gradient_of_another_shape_raises_on_every_rank(group, strategy, gradient, shard):
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make_optimizer("adam", shard)
    ref = Reference("adam")
    pairs = [(local_grad(n, 0, group.rank), variables[n]) for n in NAMES]
    for built in (False, True):  # on the first step, then once built
        bad_pairs = [(gradient() if n == "w" else g, v) for (g, v), n in zip(pairs, NAMES, strict=True)]
        raises_on_every_rank(
            group.comm, InvalidArgumentError, lambda p=bad_pairs: run_step(strategy, opt, p), "'w'"
        )
        if not built:
            run_step(strategy, opt, pairs)
            ref.step({n: summed_grad(n, 0, group.size) for n in NAMES})
    bad = unchanged(variables, opt, "adam", ref.params, reference_slots(ref))
    all_ranks_agree(group.comm, not bad and int(opt.iterations.numpy()) == 1, "; ".join(bad))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize(
    "gradient",
    [lambda: np.float32(1.0), lambda: np.ones((5, 4), np.float32), lambda: np.ones((4, 5), np.complex64)],
    ids=["scalar", "transposed", "complex"],
)
def test_a_bad_gradient_on_one_rank_raises_on_every_rank(world, gradient, shard):
    variables = make_variables(world.strategy)
    with world.strategy.scope():
        opt = make_optimizer("momentum", shard)
    ref = Reference("momentum")
    for t in range(2):  # before the first step and after it
        pairs = [
            (
                gradient() if n == "w" and world.rank == world.size - 1 else local_grad(n, t, world.rank),
                variables[n],
            )
            for n in NAMES
        ]
        raises_on_every_rank(
            world.comm, InvalidArgumentError, lambda p=pairs: run_step(world.strategy, opt, p), "'w'"
        )
        run_step(world.strategy, opt, [(local_grad(n, t, world.rank), variables[n]) for n in NAMES])
        ref.step({n: summed_grad(n, t, world.size) for n in NAMES})
    bad = unchanged(variables, opt, "momentum", ref.params, reference_slots(ref))
    all_ranks_agree(world.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_a_complex_gradient_for_a_float_variable_raises_on_every_rank(group, strategy, dtype, shard):
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make_optimizer("sgd", shard)
    pairs = [
        (
            local_grad(n, 0, group.rank).astype(dtype) if n in ("b", "d") else local_grad(n, 0, group.rank),
            variables[n],
        )
        for n in NAMES
    ]
    raises_on_every_rank(group.comm, InvalidArgumentError, lambda: run_step(strategy, opt, pairs), "complex")
    bad = differences(weights(variables), Reference("sgd").params, ROUNDING)
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_a_variable_given_twice_raises_on_every_rank(group, shard):
    variables = make_variables(group.strategy, ["w", "b"])
    with group.strategy.scope():
        opt = make_optimizer("momentum", shard)
    g = local_grad("w", 0, group.rank)
    twice = [(g, variables["w"]), (local_grad("b", 0, group.rank), variables["b"]), (g, variables["w"])]
    raises_on_every_rank(
        group.comm, InvalidArgumentError, lambda: run_step(group.strategy, opt, twice), "more than one"
    )
    bad = differences(weights(variables), Reference("momentum", ["w", "b"]).params)
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("when", ["first-step", "built", "one-unbuilt", "subset"])
def test_different_variables_on_different_ranks_raise_on_every_rank(world, when, shard):
    """Rank 0 gives gradients for w only, the others for b only (or: for w and a new b, or: for
    w and b while rank 0 gives w alone): every rank raises, nothing moves, and the optimizer
    works after."""
    variables = make_variables(world.strategy)
    w, b = variables["w"], variables["b"]
    with world.strategy.scope():
        opt = make_optimizer("adam", shard)
    ref = Reference("adam", ["w", "b"])
    grad = {n: local_grad(n, 0, world.rank) for n in ("w", "b")}
    if when == "built":
        run_step(world.strategy, opt, [(grad["w"], w), (grad["b"], b)])
        ref.step({n: summed_grad(n, 0, world.size) for n in ("w", "b")})
    elif when in ("one-unbuilt", "subset"):
        run_step(world.strategy, opt, [(grad["w"], w)] + ([(grad["b"], b)] if when == "subset" else []))
        ref.step({n: summed_grad(n, 0, world.size) for n in (["w", "b"] if when == "subset" else ["w"])})
    if when in ("first-step", "built"):
        pairs = [(grad["w"], w)] if world.rank == 0 else [(grad["b"], b)]
    else:
        pairs = [(grad["w"], w)] if world.rank == 0 else [(grad["w"], w), (grad["b"], b)]
    raises_on_every_rank(world.comm, MpistratError, lambda: run_step(world.strategy, opt, pairs))
    got = {"w": w.numpy(), "b": b.numpy()}
    bad = differences(got, ref.params)
    steps = int(opt.iterations.numpy())
    # the same pairs everywhere still work, from where the variables were
    run_step(world.strategy, opt, [(local_grad(n, 1, world.rank), variables[n]) for n in ("w", "b")])
    ref.step({n: summed_grad(n, 1, world.size) for n in ("w", "b")})
    got = {"w": w.numpy(), "b": b.numpy()}
    bad += differences(got, ref.params)
    if not same_bytes_on_every_rank(world.comm, got) or steps != ref.t - 1:
        bad.append(f"copies differ, or {steps} steps counted")
    all_ranks_agree(world.comm, not bad, "; ".join(bad))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_shard_state_differing_between_ranks_raises_on_every_rank(world, kind):
    variables = make_variables(world.strategy)
    with world.strategy.scope():
        opt = make_optimizer(kind, shard=world.rank == 0)
    pairs = [(local_grad(n, 0, world.rank), variables[n]) for n in NAMES]
    raises_on_every_rank(
        world.comm, MpistratError, lambda: run_step(world.strategy, opt, pairs), "shard_state"
    )
    with world.strategy.scope():
        build = lambda: make_optimizer(kind, shard=world.rank != 0).build(list(variables.values()))  # noqa: E731
        raises_on_every_rank(world.comm, CollectiveMismatchError, build, "shard_state")
    bad = differences(weights(variables), Reference(kind).params, ROUNDING)
    all_ranks_agree(world.comm, not bad, "; ".join(bad))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_a_hierarchical_sum_in_one_ranks_optimizer_options_raises_on_every_rank(world, shard):
    """Its gradients would be summed within nodes and between their leaders while the others sum
    them over every rank at once: the build names the difference, before any step (list or stream)."""
    variables = make_variables(world.strategy)
    route = CommunicationOptions(implementation="HIERARCHICAL") if world.rank == 0 else None
    with world.strategy.scope():
        opt = SGD(LR, shard_state=shard, communication_options=route)
    pairs = [(local_grad(n, 0, world.rank), variables[n]) for n in NAMES]
    raises_on_every_rank(
        world.comm,
        CollectiveMismatchError,
        lambda: run_step(world.strategy, opt, pairs),
        "CommunicationOptions.implementation: rank 0: CommunicationOptions.implementation HIERARCHICAL",
    )
    with world.strategy.scope():
        opt = SGD(LR, shard_state=shard)  # the same everywhere: the step goes through
    run_step(world.strategy, opt, pairs)
    ref = Reference("sgd")
    ref.step({n: summed_grad(n, 0, world.size) for n in NAMES})
    bad = differences(weights(variables), ref.params, ROUNDING)
    all_ranks_agree(world.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_a_variable_of_another_strategy_raises_on_every_rank(group, shard):
    other = mpistrat.MPIStrategy(group.comm)
    try:
        mine = make_variables(group.strategy, ["w", "b"])
        theirs = make_variables(other, ["d"])
        with group.strategy.scope():
            opt = make_optimizer("adam", shard)
        grads = {n: local_grad(n, 0, group.rank) for n in ("w", "b", "d")}
        mixed = [(grads["w"], mine["w"]), (grads["d"], theirs["d"])]
        raises_on_every_rank(
            group.comm, InvalidArgumentError, lambda: run_step(group.strategy, opt, mixed), "strategy"
        )
        run_step(group.strategy, opt, [(grads["w"], mine["w"]), (grads["b"], mine["b"])])
        later = [(grads["b"], mine["b"]), (grads["d"], theirs["d"])]
        raises_on_every_rank(
            group.comm, InvalidArgumentError, lambda: run_step(group.strategy, opt, later), "strategy"
        )
        with group.strategy.scope():
            raises_on_every_rank(
                group.comm, InvalidArgumentError, lambda: opt.build([theirs["d"]]), "strategy"
            )
        ref = Reference("adam", ["w", "b", "d"])
        ref.step({n: summed_grad(n, 0, group.size) for n in ("w", "b")})
        got = {**weights(mine), **weights(theirs)}
        bad = differences(got, ref.params)
    finally:
        other.experimental_finalize()
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


# -- 6: variables() and state_nbytes() ---------------------------------------------------------

BIG = {"w": (30, 40), "s": (), "d": (333,)}  # float32, float32, float64: padding is small beside them


@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_variables_and_state_nbytes(group, kind):
    R, nslots = group.size, len(SLOTS[kind])
    sizes = {np.dtype(np.float32): 30 * 40 + 1, np.dtype(np.float64): 333}
    got, listed = {}, {}
    for shard in (False, True):
        with group.strategy.scope():
            variables = {
                n: mpistrat.Variable(np.ones(shape, SHAPES[n][1]), name=f"{n}-{shard}")
                for n, shape in BIG.items()
            }
            opt = make_optimizer(kind, shard)
        empty = opt.state_nbytes()
        run_step(
            group.strategy,
            opt,
            [(np.full(v.shape, group.rank + 1, v.dtype), v) for v in variables.values()],
        )
        got[shard] = (empty, opt.state_nbytes())
        listed[shard] = [
            (getattr(v, "name", None), v.shape, v.dtype, type(v).__name__) for v in opt.variables()
        ]
    bad = (
        [f"state_nbytes before any step: {got[False][0]}, {got[True][0]}"]
        if got[False][0] or got[True][0]
        else []
    )
    # Every slot whole (unsharded) or its ceil(N/R) part (sharded), plus buffers: a pack of gradients
    # (the whole flat size N, padded to R blocks when sharded) and, sharded, the reduced block.
    full = sum(nslots * n * dt.itemsize for dt, n in sizes.items())
    part = sum(nslots * -(-n // R) * dt.itemsize for dt, n in sizes.items())
    full_buffers = sum(2 * n * dt.itemsize for dt, n in sizes.items())
    part_buffers = sum((R * -(-n // R) + 2 * -(-n // R)) * dt.itemsize for dt, n in sizes.items())
    replicated, sharded = got[False][1], got[True][1]
    if not full <= replicated <= full + full_buffers:
        bad.append(f"replicated state_nbytes {replicated} not in [{full}, {full + full_buffers}]")
    if not part <= sharded <= part + part_buffers:
        bad.append(f"sharded state_nbytes {sharded} not in [{part}, {part + part_buffers}]")
    if R > 1 and not (sharded < replicated and sharded - part_buffers <= full / R + 64):
        bad.append(f"sharding did not shrink the slots: {sharded} vs {replicated} at {R} ranks")
    if R == 1 and sharded != replicated:
        bad.append(f"at one rank sharded state_nbytes {sharded} != {replicated}")
    # variables(): the step counter, the learning rate, then each variable's slots, the same names,
    # shapes and dtypes
    for shard, rows in listed.items():
        want_kind = "ShardedSlot" if shard else "MirroredVariable"
        want = [
            (f"{n}-{shard}/{s}", shape, np.dtype(SHAPES[n][1]), want_kind)
            for n, shape in BIG.items()
            for s in SLOTS[kind]
        ]
        rate = (f"{type(opt).__name__}/learning_rate", (), np.dtype(np.float64), "Variable")
        if rows[2:] != want or rows[0][1:] != ((), np.dtype(np.int64), "MirroredVariable") or rows[1] != rate:
            bad.append(f"variables() with shard_state={shard}: {rows}")
    all_ranks_agree(group.comm, not bad, "; ".join(bad))
