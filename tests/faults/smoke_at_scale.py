"""A smoke job for many (oversubscribed) ranks: one of each per-step operation, checked against NumPy.

An all_reduce, an uneven all_gather, an optimizer step (sharded state too) and a merge_call, each
compared with the value NumPy computes from what every rank contributed. Rank 0 alone prints one
line at the end; a wrong value raises, which ends the job with that rank's traceback.
"""

import numpy as np

import mpistrat
from mpistrat.optimizers import SGD

strategy = mpistrat.MPIStrategy()
rank, size = strategy.extended.rank, strategy.num_replicas_in_sync
ctx = mpistrat.get_replica_context


def check(what: str, got: object, want: object) -> None:
    if not np.allclose(np.asarray(got), np.asarray(want)):
        raise AssertionError(f"rank {rank}: {what}: got {got}, want {want}")


summed = strategy.run(lambda: ctx().all_reduce("sum", np.full(3, rank + 1.0, np.float32)))
check("all_reduce", summed, np.full(3, size * (size + 1) / 2))

rows = strategy.run(lambda: ctx().all_gather(np.full((rank % 3, 2), float(rank)), axis=0))
check("uneven all_gather", rows, np.concatenate([np.full((r % 3, 2), float(r)) for r in range(size)]))

for shard in (False, True):
    with strategy.scope():
        w = mpistrat.Variable(np.ones(5, np.float32), name=f"w{shard}")
        opt = SGD(0.5, momentum=0.9, shard_state=shard)
    strategy.run(opt.apply_gradients, args=([(np.full(5, rank + 1.0, np.float32), w)],))
    check(f"optimizer step (shard_state={shard})", w.numpy(), 1.0 - 0.5 * size * (size + 1) / 2)


def merge_fn(s: mpistrat.Strategy, v: mpistrat.PerReplica) -> object:
    return s.reduce("SUM", v, axis=None)


merged = strategy.run(lambda: ctx().merge_call(merge_fn, args=(np.float64(rank),)))
check("merge_call", merged, size * (size - 1) / 2)
flagged = strategy.extended.stragglers().flagged
if flagged:
    raise AssertionError(f"rank {rank}: stragglers flagged in a job with none: {flagged}")
if rank == 0:
    print(f"smoke at {size} ranks: all checked against NumPy", flush=True)
