"""Rank 1 raises inside strategy.run while the others go on to an all_reduce."""

import numpy as np

import mpistrat

strategy = mpistrat.MPIStrategy()


def step():
    if mpistrat.get_replica_context().replica_id_in_sync_group == 1:
        raise RuntimeError("boom on rank 1")
    return mpistrat.get_replica_context().all_reduce("sum", np.ones(2))


strategy.run(step)
