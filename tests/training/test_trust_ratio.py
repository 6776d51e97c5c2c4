"""LAMB's trust ratios on variables of several cache blocks, held whole or cut between packs.

The step sums each variable's norms block by block in the update's pass, and (unsharded) steps a
variable held whole in one pack right after its last block (``training/trust_ratio.py``). Weights
and slots after a few steps are compared with LAMB's arithmetic written out in float64 on the
summed gradient, whole variable at a time, sharded or not, with exact sums or not, and through the
generator step. Rank r's gradient is ``(r + 1)`` times multiples of 1/8, so their sums are exact.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import mpistrat
from mpistrat.optimizers import Lamb
from mpistrat.training.pack_step import BLOCK
from tests.conftest import all_ranks_agree

LR, DECAY, STEPS = 0.05, 0.1, 3
# name: (elements, dtype); "big" spans several blocks, "cut" is cut between packs, "zero" starts at
# zero (a weight norm of 0: ratio 1) and "still" has no gradient (a direction of 0: ratio 1)
VARIABLES = {
    "big": (BLOCK + 5, np.float32),
    "small": (17, np.float32),
    "cut": (BLOCK // 2 + 1000, np.float32),
    "zero": (300, np.float32),
    "still": (40, np.float32),
    "wide": (BLOCK // 8 + 3, np.float64),
}
PACK_BYTES = (BLOCK + 2000) * 4  # "cut" then crosses from the first float32 pack to the second


def initial(name: str) -> np.ndarray:
    size, dtype = VARIABLES[name]
    if name == "zero":
        return np.zeros(size, dtype)
    return (0.5 + np.arange(size) % 11 / 8.0).astype(dtype)


def pattern(name: str, step: int) -> np.ndarray:
    size, dtype = VARIABLES[name]
    if name == "still":
        return np.zeros(size, dtype)
    return (((np.arange(size) * 5 + step) % 9 - 4) / 8.0).astype(dtype)


@functools.cache
def reference(size: int) -> dict[str, np.ndarray]:
    """Keras's LAMB with decoupled weight decay, in float64 on the summed gradient."""
    ranks = size * (size + 1) / 2
    out = {}
    for name in VARIABLES:
        w = initial(name).astype(np.float64)
        m, v = np.zeros_like(w), np.zeros_like(w)
        for t in range(STEPS):
            g = pattern(name, t).astype(np.float64) * ranks
            w = w - w * DECAY * LR
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            u = (m / (1 - 0.9 ** (t + 1))) / (np.sqrt(v / (1 - 0.999 ** (t + 1))) + 1e-7)
            w_norm, u_norm = np.linalg.norm(w), np.linalg.norm(u)
            w = w - (w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0) * LR * u
        out[name], out[f"{name}/m"], out[f"{name}/v"] = w, m, v
    return out


@pytest.mark.parametrize("mode", ["float", "exact", "generator"])
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("pack_bytes", [0, PACK_BYTES], ids=["one-pack", "cut"])
def test_lamb_over_blocks_and_packs_matches_numpy(world, pack_bytes, shard, mode):
    """``exact``: ``deterministic=True``'s sums; ``generator``: the streamed step, float sums."""
    exact, stream = mode == "exact", mode == "generator"
    options = mpistrat.CommunicationOptions(bytes_per_pack=pack_bytes, deterministic=exact)
    strategy = mpistrat.MPIStrategy(world.comm, communication_options=options)
    with strategy.scope():
        variables = {n: mpistrat.Variable(initial(n), name=n) for n in VARIABLES}
        opt = Lamb(LR, weight_decay=DECAY, shard_state=shard)
    for t in range(STEPS):
        pairs = [(pattern(n, t) * (world.rank + 1), v) for n, v in variables.items()]
        if stream and t > 0:  # the first step builds; then each pack's sum starts as its gradient comes
            strategy.run(lambda pairs=pairs: opt.apply_gradients(p for p in reversed(pairs)))
        else:
            strategy.run(lambda pairs=pairs: opt.apply_gradients(pairs))
    with strategy.scope():
        got = {n: v.numpy() for n, v in variables.items()}
        got |= {f"{n}/{s}": opt.get_slot(v, s).numpy() for n, v in variables.items() for s in "mv"}
    strategy.experimental_finalize()
    bad = []
    for name, want in reference(world.size).items():
        dtype = VARIABLES[name.split("/")[0]][1]
        tol = {"rtol": 2e-5, "atol": 1e-6} if dtype == np.float32 else {"rtol": 1e-10, "atol": 1e-12}
        if got[name].dtype != dtype or not np.allclose(got[name], want, **tol):
            worst = np.abs(got[name] - want).max()
            bad.append(f"{name}: off by up to {worst:.3g}")
    all_ranks_agree(world.comm, not bad, "; ".join(bad))
