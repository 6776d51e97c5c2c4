"""merge_fn raises on rank 0: every rank raises the same type, and the strategy goes on working."""

import numpy as np

import mpistrat

strategy = mpistrat.MPIStrategy()
rank = strategy.extended.rank


class StepFailed(Exception):
    pass


def merge_fn(strategy, value):
    raise StepFailed(f"merge_fn saw {len(value.values)} replicas")


try:
    strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn, args=(np.ones(2),)))
    print(f"rank {rank}: no error", flush=True)
except StepFailed as exc:
    print(f"rank {rank} raised StepFailed: {exc}", flush=True)

total = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(2)))
assert total.tolist() == [3.0, 3.0], total
print(f"rank {rank} after: ok", flush=True)
