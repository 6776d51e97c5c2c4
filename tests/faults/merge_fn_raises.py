"""merge_fn raises on rank 0: every rank raises the same type, and the strategy goes on working.

With the argument ``exit``: an every-rank merge_fn calls ``sys.exit(3)`` on rank 1 while the
others reduce inside it; every rank exits with 3, one line naming rank 1.
"""

import sys

import numpy as np

import mpistrat

if sys.argv[1:] == ["exit"]:
    strategy = mpistrat.MPIStrategy(merge_call="every_rank")

    def leaves_on_rank_1(strategy, value):
        if strategy.extended.rank == 1:
            sys.exit(3)
        return strategy.reduce("sum", value, axis=None)

    strategy.run(lambda: mpistrat.get_replica_context().merge_call(leaves_on_rank_1, args=(np.ones(2),)))
    print(f"rank {strategy.extended.rank} went on", flush=True)

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
