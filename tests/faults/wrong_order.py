"""Rank 0 calls all_gather where the others call all_reduce."""

import numpy as np

import mpistrat

strategy = mpistrat.MPIStrategy()
rank = strategy.extended.rank


def step():
    ctx = mpistrat.get_replica_context()
    if rank == 0:
        return ctx.all_gather(np.ones(2), axis=0)
    return ctx.all_reduce("sum", np.ones(2))


try:
    print(f"rank {rank}: no error, got {strategy.run(step)}", flush=True)
except mpistrat.CollectiveMismatchError as exc:
    print(f"rank {rank} mismatch: {exc}", flush=True)

gathered = strategy.run(lambda: mpistrat.get_replica_context().all_gather(np.array([rank]), axis=0))
assert gathered.tolist() == [0, 1, 2], gathered
print(f"rank {rank} after: ok", flush=True)
