"""Under MPISTRAT_CHECK=step, after the last step, rank 1 passes a cross-replica ``reduce`` a shape
of the same size as the others' but another (MPI moves the same bytes), and every rank's program
ends without finalizing the strategy: no handshake is left to check it."""

import numpy as np

import mpistrat

strategy = mpistrat.MPIStrategy()
rank = strategy.extended.rank
strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(3)))
strategy.reduce("sum", np.ones((3, 2) if rank == 1 else (2, 3)), axis=None)
print(f"rank {rank} reached the end", flush=True)
