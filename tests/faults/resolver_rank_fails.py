"""Rank 1 fails while the others create ``MultiWorkerMirroredStrategy(cluster_resolver=...)``.

Every rank describes itself to ``SlurmClusterResolver`` as srun would (one node, as many tasks as
ranks). How rank 1 fails is the first argument:

``exit``: a strategy exists; rank 1 calls ``sys.exit(0)`` where the others create the second one.
Its exit hook tells them, and they end the job at once, naming it.
``slurm``: no strategy yet; rank 1's ``SlurmClusterResolver()`` raises on a malformed
``SLURM_STEP_TASKS_PER_NODE`` (an uncaught error before any strategy could end the job): the
others wait in the creation no longer than the timeout (``MPISTRAT_TIMEOUT``), then end the job.
"""

import os
import sys

from mpi4py import MPI

import mpistrat
from mpistrat.cluster_resolver import SlurmClusterResolver

how = sys.argv[1]
rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
os.environ.update(
    SLURM_PROCID=str(rank),
    SLURM_STEP_NUM_TASKS=str(size),
    SLURM_STEP_NODELIST="node01",
    SLURM_STEP_TASKS_PER_NODE=str(size),
)
if how == "exit":
    first = mpistrat.MPIStrategy()
    first.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1.0))
    if rank == 1:
        sys.exit(0)
if how == "slurm" and rank == 1:
    os.environ["SLURM_STEP_TASKS_PER_NODE"] = f"{size}(x"
resolver = SlurmClusterResolver()
strategy = mpistrat.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
print(f"rank {rank} created its strategy", flush=True)
