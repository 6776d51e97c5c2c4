"""Rank 0 is 2.5 s late to a merge_call, then its merge_fn takes 0.5 s: one stall, one warning."""

import time

import mpistrat

strategy = mpistrat.MPIStrategy()
rank = strategy.extended.rank


def merge_fn(strategy):
    time.sleep(0.5)  # less than the stall threshold: the broadcast after it is no new stall
    return 1


def step():
    if rank == 0:
        time.sleep(2.5)
    return mpistrat.get_replica_context().merge_call(merge_fn)


assert strategy.run(step) == 1
time.sleep(1.5)
print(f"rank {rank} finished", flush=True)
