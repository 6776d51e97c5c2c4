"""Rank 1's backward pass raises in the middle of a generator step, with sums in flight.

The layers are cut into several pieces, so mpistrat's progress thread runs while the generator does
(``nothread``: ``progress.PERIOD = 0``, none runs: the behaviour to compare with). ``raise``: the error
goes uncaught; ``caught``: every rank catches it and goes on to two more steps. Rank 1 prints whether
the thread ran when it raised; each rank prints ``rank <r> caught ...``, and ``rank <r> finished``
with whether a progress thread is left.
"""

import sys
import threading

import numpy as np

import mpistrat
from mpistrat.collectives import progress
from mpistrat.optimizers import SGD

how = sys.argv[1]
if "nothread" in sys.argv[2:]:
    progress.PERIOD = 0.0

strategy = mpistrat.MPIStrategy()
rank = strategy.extended.rank
with strategy.scope():
    layers = [mpistrat.Variable(np.zeros(1 << 18, np.float32), name=f"layer{k}") for k in range(4)]
    optimizer = SGD(0.5)


def pumping() -> bool:
    return any(t.name == "mpistrat-progress" for t in threading.enumerate())


def backward(step: int):
    for k in reversed(range(len(layers))):
        if step == 1 and rank == 1 and k == 1:
            print(f"rank 1 raises with the progress thread running: {pumping()}", flush=True)
            raise FloatingPointError("the backward pass failed on rank 1")
        yield np.ones(1 << 18, np.float32), layers[k]


strategy.run(lambda: optimizer.apply_gradients([(np.ones(1 << 18, np.float32), w) for w in layers]))
for step in (1, 2, 3):
    try:
        strategy.run(lambda: optimizer.apply_gradients(backward(step)))  # noqa: B023
    except FloatingPointError as exc:
        if how != "caught":
            raise
        print(f"rank {rank} caught {exc}", flush=True)
print(
    f"rank {rank} finished, weights {layers[0].numpy()[0]}, a progress thread left: {pumping()}", flush=True
)
