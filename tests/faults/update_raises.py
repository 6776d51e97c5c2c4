"""A custom optimizer's update raises on rank 1 alone, at the second step, inside the step's transfers.

The first argument is the step: ``sharded`` (``shard_state=True``: the update runs between the
reduce-scatter and the all-gather), ``groups`` (unsharded, a float32 and a float64 variable: the
update of the first group runs before the second group's all-reduce) or ``stream`` (a generator of
pairs, sharded: updates as the sums complete). With ``caught`` every rank catches the error and
goes on to the next step. Each rank prints ``rank <r> caught ...`` or ``rank <r> finished``.
"""

import sys

import numpy as np

import mpistrat

step_kind = sys.argv[1]
caught = "caught" in sys.argv[2:]


class FailsOnRank1(mpistrat.optimizers.SGD):
    def _update_flat(self, w, g, slots, lr, step):
        if step == 1 and rank == 1:
            raise FloatingPointError("the update failed on rank 1")
        super()._update_flat(w, g, slots, lr, step)


strategy = mpistrat.MPIStrategy()
rank = strategy.extended.rank
with strategy.scope():
    w = mpistrat.Variable(np.zeros(8, np.float32), name="w")
    b = mpistrat.Variable(np.zeros(3, np.float64), name="b")
    optimizer = FailsOnRank1(0.5, shard_state=step_kind != "groups")


def pairs():
    yield np.ones(8, np.float32), w
    yield np.ones(3, np.float64), b


def step():
    optimizer.apply_gradients(pairs() if step_kind == "stream" else list(pairs()))


for _ in range(3):
    try:
        strategy.run(step)
    except FloatingPointError as exc:
        if not caught:
            raise
        print(f"rank {rank} caught {exc}", flush=True)
print(f"rank {rank} finished", flush=True)
