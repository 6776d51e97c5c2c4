"""``LossScaleOptimizer``: a step whose summed gradient is not finite on any rank is skipped on every
rank alike, the scale halves and nothing is written; clean steps apply the unscaled sum and the
scale doubles after ``dynamic_growth_steps`` of them; a checkpoint keeps the scale.

The reference is serial NumPy Adam (``test_flat_optimizers.Reference``) on the summed gradients
of the steps that were applied.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

import mpistrat
from mpistrat import InvalidArgumentError
from mpistrat.optimizers import SGD, Adam, LossScaleOptimizer
from tests.conftest import RankChecks, all_ranks_agree
from tests.training import test_flat_optimizers as flat
from tests.training.test_flat_optimizers import NAMES, differences, local_grad, make_variables, summed_grad

SCALE = 64.0


@pytest.mark.parametrize("stream", [False, True], ids=["list", "generator"])
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_a_step_not_finite_on_one_rank_is_skipped_on_every_rank(group, shard, stream):
    strategy = mpistrat.MPIStrategy(group.comm, communication_options=mpistrat.CommunicationOptions(32))
    variables = make_variables(strategy)
    with strategy.scope():
        opt = LossScaleOptimizer(
            Adam(flat.LR, beta_1=flat.B1, beta_2=flat.B2, epsilon=flat.EPS, shard_state=shard),
            initial_scale=SCALE,
            dynamic_growth_steps=2,
        )
    bad_rank = group.size - 1
    history = []  # (scale, applied) per call
    for t in range(5):
        scale = float(opt.dynamic_scale.numpy())
        poisoned = t == 1  # one rank's gradient of one variable holds an inf (float16, as mixed precision)

        def pairs(t=t, scale=scale, poisoned=poisoned):
            for n in reversed(NAMES):
                g = (local_grad(n, t, group.rank) * scale).astype(np.float16)
                if poisoned and group.rank == bad_rank and n == "b":
                    g[0] = np.inf
                yield g, variables[n]

        streamed = stream and t > 0  # the first step builds: a list
        strategy.run(lambda p=pairs, s=streamed: opt.apply_gradients(p() if s else list(p())))
        history.append((scale, int(opt.iterations.numpy())))
    ref = flat.Reference("adam")
    for t in (0, 2, 3, 4):  # step 1 was skipped
        ref.step({n: summed_grad(n, t, group.size) for n in NAMES})
    bad = differences(flat.weights(variables), ref.params)
    # scales: 64 (applied), 64 (skipped: halves), 32, 32 (two applied: doubles), 64
    want = [(64.0, 1), (64.0, 1), (32.0, 2), (32.0, 3), (64.0, 4)]
    if history != want:
        bad.append(f"(scale, iterations) per call {history}, expected {want}")
    strategy.experimental_finalize()
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


def test_the_scale_is_checkpointed_and_arguments_are_checked(group):
    with group.strategy.scope():
        w = mpistrat.Variable(np.zeros(2), name="w")
        opt = LossScaleOptimizer(SGD(0.1), initial_scale=8.0)
    group.strategy.run(lambda: opt.apply_gradients([(np.array([np.nan, 1.0]), w)]))
    ckpt = mpistrat.Checkpoint(w=w, opt=opt)
    directory = group.comm.bcast(tempfile.mkdtemp() if group.rank == 0 else None)
    path = ckpt.save(os.path.join(directory, "ckpt"))
    group.strategy.run(lambda: opt.apply_gradients([(np.array([np.inf, 1.0]), w)]))
    checks = RankChecks()
    checks.that(float(opt.dynamic_scale.numpy()) == 2.0)
    ckpt.restore(path).assert_consumed()
    checks.that(float(opt.dynamic_scale.numpy()) == 4.0 and np.array_equal(w.numpy(), np.zeros(2)))
    checks.agree(group.comm, f"{opt.dynamic_scale.numpy()} {w.numpy()}")
    with pytest.raises(InvalidArgumentError, match="initial_scale must be a number > 0"):
        LossScaleOptimizer(SGD(), initial_scale=0.0)
    with pytest.raises(InvalidArgumentError, match="dynamic_growth_steps must be an integer >= 1"):
        LossScaleOptimizer(SGD(), dynamic_growth_steps=0)
    with pytest.raises(InvalidArgumentError, match="loss_scale_factor of its own"):
        LossScaleOptimizer(SGD(loss_scale_factor=2.0))


def test_a_save_mid_window_through_a_loss_scale_optimizer_waits_for_the_windows_end(group, tmp_path):
    """The inner optimizer's accumulation is the wrapper's: a manager with save_at_window_end makes a
    save called after 1 of 2 calls at the end of the step of the second, the weights after the update
    (SGD on the mean of the two summed gradients) and no accumulation entries in the file."""
    from mpistrat.checkpoint.files import read_table

    with group.strategy.scope():
        w = mpistrat.Variable(np.zeros(2), name="w")
        opt = LossScaleOptimizer(SGD(0.5, gradient_accumulation_steps=2), initial_scale=4.0)
    directory = group.comm.bcast(str(tmp_path) if group.rank == 0 else None)
    manager = mpistrat.CheckpointManager(
        mpistrat.Checkpoint(w=w, opt=opt), directory, max_to_keep=None, save_at_window_end=True
    )
    grads = [np.array([1.0, 2.0]) * (group.rank + 1), np.array([3.0, -1.0]) * (group.rank + 1)]
    group.strategy.run(lambda: opt.apply_gradients([(grads[0] * 4.0, w)]))
    path = manager.save()
    waited = not os.path.exists(path)
    group.strategy.run(lambda: opt.apply_gradients([(grads[1] * 4.0, w)]))
    ranks = sum(r + 1 for r in range(group.size))
    want = -0.5 * (np.array([1.0, 2.0]) + np.array([3.0, -1.0])) * ranks / 2
    entries = sorted(read_table(path).entries) if os.path.exists(path) else []
    checks = RankChecks()
    checks.that(opt.gradient_accumulation_steps == 2 and waited and entries and np.allclose(w.numpy(), want))
    checks.that(not [n for n in entries if "/accumulation/" in n])
    checks.agree(group.comm, f"{waited} {entries} {w.numpy()} {want}")
