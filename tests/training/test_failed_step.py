"""A step that raises has written nothing: no variable, no slot, no ``iterations``.

An fp16 overflow is found only once a pack's gradients are summed; with several packs (a small
``bytes_per_pack``, or variables of two dtypes) an earlier pack must not be updated when a later
one overflows, or a retry with a loss scale would apply the first part twice. The same with a
base argument that reduces every pack before the first update (``global_clipnorm``, here too
large to clip).
"""

import numpy as np
import pytest

import mpistrat
from mpistrat import CommunicationOptions, InvalidArgumentError
from tests.conftest import all_ranks_agree, raises_on_every_rank

SHAPES = [(6,), (2, 3), (5,)]  # 16 elements: 4 packs of 16 bytes in float32


_STRATEGIES: dict[tuple[str, str], mpistrat.MPIStrategy] = {}


def strategy_for(group, codec):
    """``group``'s ranks in packs of 16 bytes, compressed (one strategy per group and codec)."""
    if (group.name, codec) not in _STRATEGIES:
        options = CommunicationOptions(bytes_per_pack=16, compression=codec)
        _STRATEGIES[group.name, codec] = mpistrat.MPIStrategy(group.comm, communication_options=options)
    return _STRATEGIES[group.name, codec]


def momentum_sgd(weights, grads, velocity, lr=0.5, momentum=0.9):
    """One step of tf's SGD with momentum, serially in float64."""
    velocity = [momentum * v - lr * g for v, g in zip(velocity, grads, strict=True)]
    return [w + v for w, v in zip(weights, velocity, strict=True)], velocity


@pytest.mark.parametrize("base", [{}, {"global_clipnorm": 1e6}], ids=["plain", "global_clipnorm"])
@pytest.mark.parametrize("codec", ["fp16", "bf16"])
@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("dtypes", [("f4", "f4", "f4"), ("f4", "f8", "f8")])
def test_an_overflow_in_a_later_pack_writes_nothing(group, codec, shard, dtypes, base):
    strategy = strategy_for(group, codec)
    start = [np.arange(np.prod(s), dtype=d).reshape(s) / 8 for s, d in zip(SHAPES, dtypes, strict=True)]
    with strategy.scope():
        ws = [mpistrat.Variable(w, name=f"w{k}") for k, w in enumerate(start)]
        opt = mpistrat.optimizers.SGD(0.5, momentum=0.9, shard_state=shard, **base)
    ones = [np.ones(s, d) for s, d in zip(SHAPES, dtypes, strict=True)]
    huge = {"fp16": 7e4, "bf16": 1e300 if dtypes[2] == "f8" else 3.4e38}[codec]
    bad = [g.copy() for g in ones]
    bad[2][-1] = huge  # the last element: the last pack, and the second dtype's group

    def step(grads):
        strategy.run(lambda: opt.apply_gradients(list(zip(grads, ws, strict=True))))

    step(ones)
    before = [w.numpy() for w in ws]
    with strategy.scope():
        slots_before = [opt.get_slot(w, "momentum").numpy() for w in ws]
    raises_on_every_rank(group.comm, InvalidArgumentError, lambda: step(bad), match="overflowed")
    with strategy.scope():
        slots_after = [opt.get_slot(w, "momentum").numpy() for w in ws]
        iterations = int(opt.iterations.numpy())
    unchanged = all(map(np.array_equal, before, [w.numpy() for w in ws]))
    unchanged = unchanged and all(map(np.array_equal, slots_before, slots_after))
    step(ones)  # the retry: exactly two steps of the sum of ones, as if the failed one never was
    n = group.size
    summed = [n * g.astype(np.float64) for g in ones]
    want, velocity = momentum_sgd([w.astype(np.float64) for w in start], summed, [0 * g for g in summed])
    want, _ = momentum_sgd(want, summed, velocity)
    close = all(
        np.allclose(w.numpy(), x, rtol=1e-6, atol=0) and w.dtype == np.dtype(d)
        for w, x, d in zip(ws, want, dtypes, strict=True)
    )
    ok = unchanged and iterations == 1 and close
    all_ranks_agree(group.comm, ok, f"unchanged {unchanged}, iterations {iterations}, close {close}")
