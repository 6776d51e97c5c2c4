"""Every optimizer and base argument against Keras 3 itself: 20 steps of fixed float32 gradients.

``data/keras_optimizers.json`` holds what Keras computed (its version and backend inside; made by
``data/make_keras_fixtures.py`` in a scratch environment: Keras is never a dependency). Each case
is repeated here from the same variables and gradients and compared, weights and slots, to
1e-6 relative (with an absolute floor of 1e-6 of the largest value, for elements that pass
through zero). Under ``mpiexec`` rank 0 gives the gradient and the other ranks zeros, so that the
sum every rank applies is Keras's gradient exactly, sharded or not, in several packs.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import mpistrat
from mpistrat.optimizers import schedules
from tests.conftest import all_ranks_agree
from tests.training.data import make_keras_fixtures as made

FIXTURES = json.loads((pathlib.Path(__file__).parent / "data" / "keras_optimizers.json").read_text())
CASES = sorted(FIXTURES["cases"])
RTOL = 1e-6
PACK = 32  # bytes: 8 float32 elements, so every variable spans packs at 1 to 4 ranks


def make(case: str, shard: bool = False):
    optimizer, base = case.split("/")
    cls, args = made.OPTIMIZERS[optimizer]
    args = {**args, **made.BASE[base]}
    if base == "schedule":
        args["learning_rate"] = schedules.ExponentialDecay(
            args["learning_rate"], decay_steps=5, decay_rate=0.5
        )
    opt = getattr(mpistrat.optimizers, cls)(**args, shard_state=shard)
    if base == "weight_decay":
        opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


def run(case: str, strategy=None, rank: int = 0, shard: bool = False) -> dict[str, np.ndarray]:
    """The case's weights and slots after its steps (collective under a strategy)."""
    scope = strategy.scope() if strategy is not None else mpistrat.get_strategy().scope()
    with scope:
        variables = {n: mpistrat.Variable(v, name=n) for n, v in made.initial().items()}
        opt = make(case, shard)
    scale = made.LOSS_SCALE if case.endswith("/loss_scale_factor") else 1.0
    for t in range(made.STEPS):
        g = made.gradients(t)
        pairs = [
            (g[n] * np.float32(scale) if rank == 0 else np.zeros_like(g[n]), variables[n])
            for n in made.SHAPES
        ]
        if strategy is None:
            opt.apply_gradients(pairs)
        else:
            strategy.run(lambda pairs=pairs: opt.apply_gradients(pairs))
    with scope:
        out = {n: v.numpy().ravel() for n, v in variables.items()}
        out |= {
            f"{n}/{s}": opt.get_slot(v, s).numpy().ravel()
            for n, v in variables.items()
            for s in opt.slot_names
        }
        if opt.use_ema:
            opt.finalize_variable_values(list(variables.values()))
            out |= {f"{n}/finalized": v.numpy().ravel() for n, v in variables.items()}
    return out


def differences(case: str, got: dict[str, np.ndarray]) -> list[str]:
    want = FIXTURES["cases"][case]
    bad = [f"{case}: entries {sorted(got)} != Keras's {sorted(want)}"] if sorted(got) != sorted(want) else []
    for name, expected in want.items():
        expected = np.asarray(expected, np.float32)
        value = got.get(name)
        if value is None:
            continue
        floor = RTOL * float(np.abs(expected).max(initial=0.0))
        if value.dtype != np.float32 or not np.allclose(value, expected, rtol=RTOL, atol=floor):
            error = np.abs(value.astype(np.float64) - expected) / np.maximum(np.abs(expected), floor or 1.0)
            bad.append(f"{case} {name}: relative error {error.max():.2e} ({value.dtype})")
    return bad


def test_the_fixtures_say_which_keras_made_them():
    assert FIXTURES["keras"].startswith("3.") and FIXTURES["steps"] == made.STEPS == 20
    assert len(CASES) == len(made.OPTIMIZERS) * len(made.BASE)


@pytest.mark.parametrize("case", CASES)
def test_one_process_matches_keras(case):
    bad = differences(case, run(case))
    assert not bad, "\n".join(bad)


# Under mpiexec (the suite's time is counted): every optimizer plain, and every base argument with
# AdamW and LAMB (per-variable decay, norms and trust ratios), sharded and replicated in turn.
SPREAD = [c for c in CASES if c.endswith("/plain") or c.split("/")[0] in ("adamw", "lamb")]


def test_the_cases_at_any_rank_count_match_keras(world):
    strategy = mpistrat.MPIStrategy(
        world.comm, communication_options=mpistrat.CommunicationOptions(bytes_per_pack=PACK)
    )
    bad = []
    for i, case in enumerate(SPREAD):
        bad += differences(case, run(case, strategy, world.rank, shard=i % 2 == 1))
    strategy.experimental_finalize()
    all_ranks_agree(world.comm, not bad, "\n".join(bad[:20]))
