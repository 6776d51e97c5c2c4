"""MPI returns an error on rank 1 in the transfer of a collective whose handshake passed (the
others wait in it); rank 1 catches what mpistrat raises and goes on computing.

With ``shapes`` instead, under ``MPISTRAT_CHECK=step``, rank 1 passes ``np.ones(4)`` where the others
pass ``np.ones(3)`` to an ``all_reduce`` at the fifth step, unchecked: what MPI makes of it depends
on the library (Open MPI returns ``MPI_ERR_TRUNCATE``, MPICH aborts in it, Intel MPI completes it).
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import mpistrat

how = sys.argv[1]


class FailingTransfer(MPI.Intracomm):
    """Rank 1's second data transfer returns an MPI error (the handshakes are not Allreduce)."""

    calls = 0

    def Allreduce(self, *args, **kwargs):
        FailingTransfer.calls += 1
        if how == "transfer" and self.Get_rank() == 1 and FailingTransfer.calls == 2:
            raise MPI.Exception(MPI.ERR_OTHER)
        return super().Allreduce(*args, **kwargs)


strategy = mpistrat.MPIStrategy(FailingTransfer(MPI.COMM_WORLD))
rank = strategy.extended.rank


def step(i):
    n = 4 if how == "shapes" and i == 5 and rank == 1 else 3
    return mpistrat.get_replica_context().all_reduce("sum", np.ones(n))


for i in range(8 if how == "shapes" else 2):
    try:
        strategy.run(step, args=(i,))
    except mpistrat.CommunicationError as exc:
        print(f"rank {rank} caught {type(exc).__name__}: {exc}", flush=True)
        time.sleep(60)  # the job ends anyway: the collective left the communicator unusable
print(f"rank {rank} finished", flush=True)
