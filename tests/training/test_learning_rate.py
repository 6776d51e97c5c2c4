"""``optimizer.learning_rate``: read and set as Keras 3 has it, applied at the next step on every rank.

The weights are compared with the serial float64 NumPy reference of the flat optimizers' tests,
stepped with the rate each step was given. A rank that sets a rate of its own, and a schedule
that returns NaN, are an error on every rank before anything is written.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

import mpistrat
from mpistrat import CollectiveMismatchError, InvalidArgumentError
from mpistrat.optimizers import SGD, Adam
from tests.conftest import all_ranks_agree, raises_on_every_rank
from tests.training import test_flat_optimizers as flat
from tests.training.test_flat_optimizers import NAMES, differences, local_grad, make_variables, summed_grad

RATES = [0.1, 0.1, 0.02, 0.3, 0.05]  # what each step is given, set between steps


def test_reading_and_setting_the_rate_as_keras_does():
    opt = SGD(0.1)
    assert isinstance(opt.learning_rate, mpistrat.Variable) and float(opt.learning_rate) == 0.1
    opt.learning_rate = 0.01
    assert float(opt.learning_rate) == 0.01 and opt.learning_rate.dtype == np.float64
    opt.learning_rate.assign(0.02)  # the variable, as Keras hands it out
    assert float(opt.learning_rate) == 0.02
    assert any(v is opt.learning_rate for v in opt.variables())
    opt.learning_rate = lambda step: 0.5 / (1 + step)  # a schedule replaces the number
    assert opt.learning_rate == 0.5
    scheduled = Adam(lambda step: 0.1 * 0.5**step)
    w = mpistrat.Variable(np.ones(2))
    scheduled.apply_gradients([(np.ones(2), w)])
    assert scheduled.learning_rate == 0.05  # the schedule's value at the current iterations
    with pytest.raises(InvalidArgumentError, match="schedule"):
        scheduled.learning_rate = 0.01
    for bad in [float("nan"), float("inf"), "fast", True, None, np.ones(2)]:
        with pytest.raises(InvalidArgumentError, match="learning_rate"):
            SGD(0.1).learning_rate = bad
        with pytest.raises(InvalidArgumentError, match="learning_rate"):
            SGD(bad)


def _train(strategy, rank, opt, variables, stream: bool) -> None:
    for t, rate in enumerate(RATES):
        opt.learning_rate = rate

        def step(t=t):
            pairs = ((local_grad(n, t, rank), variables[n]) for n in reversed(NAMES))
            opt.apply_gradients(pairs if stream and t > 0 else list(pairs))  # the first step builds

        strategy.run(step)


@pytest.mark.parametrize("stream", [False, True], ids=["list", "generator"])
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_a_rate_set_between_steps_is_the_next_steps_on_every_rank(group, kind, shard, stream):
    strategy = mpistrat.MPIStrategy(group.comm, communication_options=mpistrat.CommunicationOptions(32))
    variables = make_variables(strategy)
    with strategy.scope():
        opt = flat.make_optimizer(kind, shard)
    _train(strategy, group.rank, opt, variables, stream)
    ref = flat.Reference(kind)
    for t, rate in enumerate(RATES):
        ref.step({n: summed_grad(n, t, group.size) for n in NAMES}, rate)
    bad = differences(flat.weights(variables), ref.params)
    strategy.experimental_finalize()
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("accumulate", [None, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["list", "generator"])
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_a_rank_that_sets_its_own_rate_fails_every_rank_and_writes_nothing(world, shard, stream, accumulate):
    if world.size == 1:
        pytest.skip("needs two ranks")
    with world.strategy.scope():
        w = mpistrat.Variable(np.arange(6.0), name="w")
        opt = Adam(0.1, shard_state=shard, gradient_accumulation_steps=accumulate)
    for _ in range(accumulate or 1):
        world.strategy.run(lambda: opt.apply_gradients([(np.ones(6), w)]))
    before = (w.numpy(), int(opt.iterations.numpy()))
    opt.learning_rate = 0.01 if world.rank == world.size - 1 else 0.02
    pairs = lambda: ((g, v) for g, v in [(np.ones(6), w)])  # noqa: E731
    for _ in range((accumulate or 1) - 1):  # the quiet calls of a cycle send nothing
        world.strategy.run(lambda: opt.apply_gradients(pairs() if stream else list(pairs())))
    raises_on_every_rank(
        world.comm,
        CollectiveMismatchError,
        lambda: world.strategy.run(lambda: opt.apply_gradients(pairs() if stream else list(pairs()))),
        "learning_rate",
    )
    after = (w.numpy(), int(opt.iterations.numpy()))
    same = np.array_equal(before[0], after[0]) and before[1] == after[1]
    all_ranks_agree(world.comm, same, f"written: {before} -> {after}")


@pytest.mark.parametrize("stream", [False, True], ids=["list", "generator"])
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_a_schedule_that_returns_nan_fails_every_rank_before_anything_is_written(group, shard, stream):
    with group.strategy.scope():
        w = mpistrat.Variable(np.arange(6.0), name="w")
        opt = SGD(lambda step: 0.1 if step < 1 else float("nan"), shard_state=shard)
    group.strategy.run(lambda: opt.apply_gradients([(np.ones(6), w)]))
    before = w.numpy()
    pairs = lambda: ((g, v) for g, v in [(np.ones(6), w)])  # noqa: E731
    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: group.strategy.run(lambda: opt.apply_gradients(pairs() if stream else list(pairs()))),
        "learning_rate at step 1",
    )
    ok = np.array_equal(w.numpy(), before) and int(opt.iterations.numpy()) == 1
    all_ranks_agree(group.comm, ok, f"{w.numpy()} {opt.iterations.numpy()}")


def test_a_checkpoint_restores_the_rate_it_saved(group):
    with group.strategy.scope():
        w = mpistrat.Variable(np.zeros(3), name="w")
        opt = SGD(0.1)
    ckpt = mpistrat.Checkpoint(w=w, opt=opt)
    opt.learning_rate = 0.05
    directory = group.comm.bcast(tempfile.mkdtemp() if group.rank == 0 else None)
    path = ckpt.save(os.path.join(directory, "ckpt"))
    opt.learning_rate = 0.3
    ckpt.restore(path).assert_consumed()
    all_ranks_agree(group.comm, float(opt.learning_rate) == 0.05, str(float(opt.learning_rate)))
