"""Optimizers: least squares on N ranks, each holding a slice of the global batch, against NumPy.

The reference is plain full-batch gradient descent written out here from the
textbook formulas. Adam is in the bias-corrected m-hat / v-hat form; tf's epsilon
is added to the uncorrected sqrt(v), so in this form it is eps / sqrt(1 - b2^t).
"""

import math

import numpy as np
import pytest

import mpistrat
from mpistrat import ContextError, InvalidArgumentError
from mpistrat.optimizers import SGD, Adam
from mpistrat.training.variables import Writable
from tests.conftest import WORLD, RankChecks, all_ranks_agree, raises_on_every_rank
from tests.support.counting import CountingComm, Ledger

RNG = np.random.default_rng(1234)
X = RNG.normal(size=(10, 3))  # 10 rows: uneven slices at 3 and 4 ranks
Y = X @ np.array([1.5, -2.0, 0.5]) + 0.25 + 0.01 * RNG.normal(size=10)
STEPS = 15

CONFIGS = {
    "sgd": (lambda lr: SGD(lr), {"kind": "sgd", "lr": 0.1}),
    "momentum": (lambda lr: SGD(lr, momentum=0.9), {"kind": "momentum", "lr": 0.05, "m": 0.9}),
    "nesterov": (lambda lr: SGD(lr, momentum=0.9, nesterov=True), {"kind": "nesterov", "lr": 0.05, "m": 0.9}),
    "adam": (lambda lr: Adam(lr), {"kind": "adam", "lr": 0.1}),
}


def gradients(w, b, rows):
    """Gradient of the global mean squared error contributed by ``rows`` (sums to the full gradient)."""
    err = X[rows] @ w + b - Y[rows]
    return 2.0 * X[rows].T @ err / len(X), 2.0 * err.sum() / len(X)


def numpy_reference(cfg, lr_of_step, steps=STEPS):
    params = [np.zeros(3), np.zeros(())]
    state = [[np.zeros_like(p), np.zeros_like(p)] for p in params]
    for k in range(steps):
        grads = gradients(params[0], params[1], np.arange(len(X)))
        lr = lr_of_step(k)
        for p, g, s in zip(params, grads, state, strict=True):
            if cfg["kind"] == "sgd":
                p -= lr * g
            elif cfg["kind"] in ("momentum", "nesterov"):
                s[0] = cfg["m"] * s[0] - lr * g
                p += cfg["m"] * s[0] - lr * g if cfg["kind"] == "nesterov" else s[0]
            else:
                b1, b2, eps, t = 0.9, 0.999, 1e-7, k + 1
                s[0] = b1 * s[0] + (1 - b1) * g
                s[1] = b2 * s[1] + (1 - b2) * g * g
                m_hat, v_hat = s[0] / (1 - b1**t), s[1] / (1 - b2**t)
                p -= lr * m_hat / (np.sqrt(v_hat) + eps / math.sqrt(1 - b2**t))
    return params


def train(group, make_opt, steps=STEPS):
    rows = np.array_split(np.arange(len(X)), group.size)[group.rank]
    with group.strategy.scope():
        w = mpistrat.Variable(np.zeros(3), name="w")
        b = mpistrat.Variable(0.0, name="b")
        opt = make_opt()

    def step():
        gw, gb = gradients(w.numpy(), b.numpy(), rows)
        opt.apply_gradients([(gw, w), (gb, b)])

    for _ in range(steps):
        group.strategy.run(step)
    return w, b, opt


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_matches_numpy_gradient_descent(group, name):
    make, cfg = CONFIGS[name]
    w, b, opt = train(group, lambda: make(cfg["lr"]))
    ref_w, ref_b = numpy_reference(cfg, lambda k: cfg["lr"])
    checks = RankChecks()
    checks.that(np.allclose(w.numpy(), ref_w, rtol=1e-10, atol=1e-12) and np.isclose(float(b.numpy()), ref_b))
    checks.that(int(opt.iterations.numpy()) == STEPS)
    checks.agree(group.comm, f"{name}: {w.numpy()} {b.numpy()} vs {ref_w} {ref_b}")


def test_learning_rate_schedule(group):
    schedule = lambda step: 0.1 / (1.0 + step)  # noqa: E731
    w, b, _ = train(group, lambda: SGD(schedule, momentum=0.5))
    ref_w, ref_b = numpy_reference({"kind": "momentum", "m": 0.5}, schedule)
    ok = np.allclose(w.numpy(), ref_w, rtol=1e-10) and np.isclose(float(b.numpy()), ref_b)
    all_ranks_agree(group.comm, ok, f"{w.numpy()} vs {ref_w}")


def test_slots_iterations_and_dtype(group):
    with group.strategy.scope():
        w = mpistrat.Variable(np.ones(2, np.float32), name="w")
        opt = Adam(0.01)
    group.strategy.run(lambda: opt.apply_gradients([(np.ones(2), w), (None, w)]))
    m, v = opt.get_slot(w, "m"), opt.get_slot(w, "v")
    checks = RankChecks()
    checks.that(w.dtype == m.dtype == np.float32 and m.colocated_with is w and not m.trainable)
    checks.that(
        isinstance(m, mpistrat.MirroredVariable) and isinstance(opt.iterations, mpistrat.MirroredVariable)
    )
    checks.that(opt.iterations.colocated_with == group.strategy.extended.non_slot_devices([w]))
    n = group.size
    checks.that(np.allclose(m.numpy(), 0.1 * n) and np.allclose(v.numpy(), 0.001 * n * n))
    checks.that(int(opt.iterations.numpy()) == 1 and len(opt.variables()) == 4)
    checks.agree(group.comm, f"{m!r} {v!r}")
    with pytest.raises(InvalidArgumentError, match="no slot"):
        opt.get_slot(w, "momentum")


def test_default_strategy_training_matches_numpy():
    w, b = mpistrat.Variable(np.zeros(3)), mpistrat.Variable(0.0)
    opt = SGD(0.1, momentum=0.9)
    for _ in range(STEPS):
        gw, gb = gradients(w.numpy(), b.numpy(), np.arange(len(X)))
        opt.apply_gradients([(gw, w), (gb, b)])
    ref_w, _ = numpy_reference({"kind": "momentum", "m": 0.9}, lambda k: 0.1)
    assert np.allclose(w.numpy(), ref_w, rtol=1e-12)


def test_apply_gradients_errors(world):
    with world.strategy.scope():
        w = mpistrat.Variable(np.zeros(2))
        opt = SGD(0.1)
        with pytest.raises(ContextError, match=r"strategy\.run"):
            opt.apply_gradients([(np.ones(2), w)])
    raises_on_every_rank(
        world.comm,
        InvalidArgumentError,
        lambda: world.strategy.run(lambda: opt.apply_gradients([(None, w)])),
        "no gr",
    )
    with pytest.raises(InvalidArgumentError, match="learning_rate"):
        SGD("fast")
    with pytest.raises(InvalidArgumentError, match="momentum"):
        SGD(0.1, momentum=2.0)
    with pytest.raises(InvalidArgumentError, match="beta_1"):
        Adam(beta_1=1.0)


def test_scalar_variables_keep_updating_after_any_write(group):
    """0-d arithmetic gives NumPy scalars; a variable must stay a 0-d array after every kind of
    write, so the optimizers' in-place steps still update it."""
    with group.strategy.scope():
        b = mpistrat.Variable(np.float64(3.0), name="b", aggregation="SUM")
        opt = SGD(1.0)
    group.strategy.run(lambda: b.assign_add(np.float64(1.0)))  # replica context: 3 + n
    held = b.value()
    with group.strategy.scope():
        b.assign_add(np.float64(1.0))  # cross-replica, with the value held: a copy, 4 + n
    for _ in range(3):
        group.strategy.run(lambda: opt.apply_gradients([(np.float64(1.0), b)]))
    n = group.size
    checks = RankChecks()
    checks.that(float(held) == 3.0 + n and float(b.numpy()) == 4.0 + n - 3 * n)
    checks.that(isinstance(b.value(), np.ndarray) and int(opt.iterations.numpy()) == 3)
    checks.agree(group.comm, f"{b.numpy()} {held}")


def test_a_variable_made_outside_the_scope_is_named_with_the_fix(group):
    plain = mpistrat.Variable(np.ones(2), name="plain")
    with group.strategy.scope():
        w = mpistrat.Variable(np.ones(2), name="w")
        opt = SGD(0.1)
    message = raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: group.strategy.run(lambda: opt.apply_gradients([(np.ones(2), w), (np.ones(2), plain)])),
        "'plain' was created outside any strategy's scope, but this optimizer updates variables in",
    )
    assert message.endswith("create it inside `with strategy.scope():`")


class Adagrad(mpistrat.optimizers.Optimizer):
    """An optimizer of one's own, one variable at a time: ``acc += g^2; w -= lr g / sqrt(acc)``."""

    slot_names = ("acc",)

    def __init__(self, learning_rate, **kwargs):
        super().__init__(learning_rate, "Adagrad", **kwargs)

    def _apply_dense(self, var, grad, lr, step, acc):
        with Writable(acc) as a:
            a += grad * grad
        with Writable(var) as w:
            w -= lr * grad / np.sqrt(a)


OUTSIDE = {
    "sgd": lambda: SGD(0.1),
    "momentum": lambda: SGD(0.1, momentum=0.9),
    "adam": lambda: Adam(0.1),
    "adam-sharded": lambda: Adam(0.1, shard_state=True),
    "one-at-a-time": lambda: Adagrad(0.1),
}


@pytest.mark.parametrize("name", list(OUTSIDE))
@pytest.mark.parametrize("used_before", [False, True])
def test_variables_and_optimizer_made_outside_the_scope_are_named_with_the_fix(group, name, used_before):
    """The commonest slip of a port: model and optimizer made before ``strategy.scope()``, the step in
    ``strategy.run``. Each rank holds unsynchronized copies, so the step is refused, variables untouched."""
    w = mpistrat.Variable(np.ones(3), name="w")
    opt = OUTSIDE[name]()
    expected = np.ones(3)
    if used_before:  # a step in the default strategy's replica context is a plain update
        opt.apply_gradients([(np.ones(3), w)])
        expected = w.numpy().copy()
    message = raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: group.strategy.run(lambda: opt.apply_gradients([(np.ones(3), w)])),
        "the variables ('w') and the optimizer were created outside any strategy's scope",
    )
    assert message.endswith("create the variables and the optimizer inside `with strategy.scope():`"), message
    all_ranks_agree(group.comm, np.array_equal(w.numpy(), expected), f"{w.numpy()} against {expected}")


def test_an_optimizer_of_ones_own_updates_one_variable_at_a_time(group):
    w, b, opt = train(group, lambda: Adagrad(0.5))
    params, acc = [np.zeros(3), np.zeros(())], [np.zeros(3), np.zeros(())]
    for _ in range(STEPS):
        for p, a, g in zip(params, acc, gradients(params[0], params[1], np.arange(len(X))), strict=True):
            a += g * g
            p -= 0.5 * g / np.sqrt(a)
    checks = RankChecks()
    checks.that(np.allclose(w.numpy(), params[0], rtol=1e-10) and np.isclose(float(b.numpy()), params[1]))
    checks.that(np.allclose(opt.get_slot(w, "acc").numpy(), acc[0], rtol=1e-10))
    checks.agree(group.comm, f"{w.numpy()} against {params[0]}")
    with pytest.raises(InvalidArgumentError, match="_update_flat"):
        Adagrad(0.5, shard_state=True)


@pytest.mark.parametrize("shard", [False, True])
def test_a_variable_whose_shape_changed_raises_on_every_rank(group, shard):
    with group.strategy.scope():
        w = mpistrat.Variable(np.ones(4, np.float32), name="w")
        opt = Adam(0.1, shard_state=shard)
    step = lambda: group.strategy.run(lambda: opt.apply_gradients([(np.ones(4, np.float32), w)]))  # noqa: E731
    step()
    before = w.numpy()
    if group.rank == group.size - 1:  # a copy given another shape behind the API's back, on one rank
        w._local_variable()._value = np.ones(5, np.float32)
    raises_on_every_rank(group.comm, InvalidArgumentError, step, "'w' is now float32[5]")
    if group.rank != group.size - 1:
        all_ranks_agree(group.comm, np.array_equal(w.numpy(), before), "a failed step wrote the variable")
    else:
        all_ranks_agree(group.comm, True)


def test_a_subclass_that_updates_one_variable_at_a_time_is_honoured(group):
    class ClippedSGD(SGD):
        def _apply_dense(self, var, grad, lr, step, *slots):
            with Writable(var) as w:
                w -= np.clip(lr * grad, -0.1, 0.1)

    with group.strategy.scope():
        w = mpistrat.Variable(np.zeros(2), name="w")
        opt = ClippedSGD(1.0)
    group.strategy.run(lambda: opt.apply_gradients([(np.full(2, 5.0), w)]))
    all_ranks_agree(group.comm, np.array_equal(w.numpy(), [-0.1, -0.1]), f"{w.numpy()}")


def test_a_one_at_a_time_step_is_one_handshake_and_one_fused_sum_at_any_rank_count():
    """Counted: a step of the per-variable path (Keras's, without merge_call) moves what one
    all_reduce of the gradients moves: its handshake and one Allreduce of their bytes, packed per
    dtype, the same at 1-4 ranks; no merge_call gather, no broadcast."""
    strategy = mpistrat.MPIStrategy(CountingComm(WORLD))
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(3), name="w")
        b = mpistrat.Variable(np.zeros(()), name="b")
        opt = Adagrad(0.5)
    grads = [(np.ones(3), w), (np.ones(()), b)]
    strategy.run(lambda: opt.apply_gradients(grads))  # builds the slots
    with Ledger.recording() as ledger:
        strategy.run(lambda: opt.apply_gradients(grads))
    strategy.experimental_finalize()
    handshake = ("Allreduce", 104)  # the counting ledger's name for the handshake's Iallreduce
    closing = [handshake] if WORLD.Get_size() > 1 else []  # strategy.run's, above one rank
    want = [handshake, ("Allreduce", 4 * 8), *closing]  # 4 float64 gradient elements, one pack
    got = [(c.name, c.sent) for c in ledger.log]
    all_ranks_agree(WORLD, got == want, f"{got} against {want}")


def test_a_one_at_a_time_update_that_diverges_is_caught_by_the_strict_check(world):
    """Under ``check="strict"`` the per-variable path compares the copies it wrote: a rank whose
    update differs (here the last, by 1) fails every rank naming the variable; alike, it passes."""
    rank, size = world.rank, world.size

    class OffByOne(SGD):
        def _apply_dense(self, var, grad, lr, step, *slots):
            with Writable(var) as w:
                w -= lr * grad + (1.0 if diverge and rank == size - 1 else 0.0)

    strategy = mpistrat.MPIStrategy(
        world.comm, communication_options=mpistrat.CommunicationOptions(check="strict")
    )
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(2, np.float32), name="w")
        opt = OffByOne(0.5)
    diverge = False
    strategy.run(lambda: opt.apply_gradients([(np.ones(2, np.float32), w)]))
    ok = np.array_equal(w.numpy(), np.full(2, -0.5 * size, np.float32))  # tf sums the gradients
    diverge = True
    step = lambda: strategy.run(lambda: opt.apply_gradients([(np.ones(2, np.float32), w)]))  # noqa: E731
    if size > 1:
        raises_on_every_rank(world.comm, mpistrat.CollectiveMismatchError, step, "variable 'w'")
    strategy.experimental_finalize()
    all_ranks_agree(world.comm, ok, f"{w.numpy()}")


@pytest.mark.parametrize("shard", [False, True])
def test_integer_variables_are_refused_at_build_on_every_rank(group, shard):
    with group.strategy.scope():
        w = mpistrat.Variable(np.zeros(1, np.int64), name="count")
        opt = SGD(0.1, shard_state=shard)
    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: group.strategy.run(lambda: opt.apply_gradients([(np.ones(1, np.int64), w)])),
        "non-floating dtype: 'count' (int64)",
    )


def test_a_step_outside_its_strategys_replica_context_is_refused(group):
    with group.strategy.scope():
        w = mpistrat.Variable(np.zeros(2), name="w")
        opt = SGD(0.1)
    group.strategy.run(lambda: opt.apply_gradients([(np.ones(2), w)]))
    other = mpistrat.MPIStrategy(group.comm)
    # outside any strategy's run (the default replica context): each rank would apply only its own
    raises_on_every_rank(group.comm, ContextError, lambda: opt.apply_gradients([(np.ones(2), w)]), "replica")
    # inside another strategy's run: the gradients would be summed over another communicator
    raises_on_every_rank(
        group.comm,
        ContextError,
        lambda: other.run(lambda: opt.apply_gradients([(np.ones(2), w)])),
        "call it inside that strategy's run",
    )
    other.experimental_finalize()
    all_ranks_agree(group.comm, np.allclose(w.numpy(), -0.1 * group.size), f"{w.numpy()}")


@pytest.mark.mpi(min_size=2)
def test_bytes_per_pack_differing_between_ranks_fails_on_every_rank(world):
    """Packs that differ would pair different numbers of transfers: the variables' creation already
    compares the strategy's options, and the optimizer's build compares its packing too."""
    options = mpistrat.CommunicationOptions(bytes_per_pack=0 if world.rank == 0 else 64)
    strategy = mpistrat.MPIStrategy(world.comm, communication_options=options)

    def train():
        with strategy.scope():
            w = mpistrat.Variable(np.zeros(100, np.float32), name="w")
            opt = SGD(0.1, shard_state=True)
        strategy.run(lambda: opt.apply_gradients([(np.ones(100, np.float32), w)]))

    raises_on_every_rank(world.comm, mpistrat.CollectiveMismatchError, train, "bytes_per_pack")
    strategy.experimental_finalize()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_fresh_optimizer_deep_copies_and_one_with_state_says_why_not(group, dtype):
    """The copy of a fresh SGD(momentum) is an optimizer of its own: two steps on another variable
    give what NumPy gives, and the original's slots are untouched. After a step, deepcopy raises a
    TypeError saying why on every rank (its slots live over the variables it updates)."""
    import copy

    with group.strategy.scope():
        w, u = mpistrat.Variable(np.zeros(3, dtype)), mpistrat.Variable(np.ones(3, dtype))
        opt = SGD(0.5, momentum=0.9)
    twin = copy.deepcopy(opt)
    grad = np.full(3, group.rank + 1, dtype)
    total = sum(r + 1 for r in range(group.size))
    for _ in range(2):
        group.strategy.run(lambda: twin.apply_gradients([(grad, u)]))
    velocity = -0.5 * total
    want = 1.0 + velocity + (0.9 * velocity - 0.5 * total)  # two steps of tf's momentum SGD
    ok = np.allclose(u.numpy(), want, rtol=1e-6) and u.dtype == dtype and not opt._slots
    all_ranks_agree(group.comm, ok, f"{u.numpy()} vs {want}")
    group.strategy.run(lambda: opt.apply_gradients([(grad, w)]))
    raises_on_every_rank(group.comm, TypeError, lambda: copy.deepcopy(opt), "cannot be deep-copied")
