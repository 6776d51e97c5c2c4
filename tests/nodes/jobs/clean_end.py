"""A job that ends normally with strategies alive at exit: over every rank, over each node's ranks,
and over every other rank. Each rank prints ``rank <r> finished``."""

import numpy as np
from mpi4py import MPI

import mpistrat

world = MPI.COMM_WORLD
strategies = [
    mpistrat.MPIStrategy(),
    mpistrat.MPIStrategy(world.Split_type(MPI.COMM_TYPE_SHARED)),
    mpistrat.MPIStrategy(world.Split(world.Get_rank() % 2)),
]
for strategy in strategies:
    total = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(3)))
    assert total.tolist() == [float(strategy.num_replicas_in_sync)] * 3, total
print(f"rank {world.Get_rank()} finished\n", end="", flush=True)
