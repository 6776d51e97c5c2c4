"""Rank 1 leaves after one all_reduce while the others go on to a second one (default settings).

How it leaves is the first argument: ``exit0``/``exit3`` (``sys.exit``), ``raise`` (an uncaught
exception, run with MPISTRAT_ABORT_ON_EXCEPTION=0), ``skip`` (it catches an error, skips the
all_reduce and reaches the end of its program), ``inside`` (its second all_reduce fails after
the handshake, in the transfer, and the error ends it: the others are inside that all_reduce),
``create`` (``sys.exit(0)`` while the others create a second strategy: they wait in its
communicator's duplication).
The others must end at once, naming rank 1. ``os_exit`` (``os._exit(0)``, which skips every
exit hook) is not covered and not tested: it shows what MPICH's ``mpiexec`` then does.
"""

import os
import sys

import numpy as np
from mpi4py import MPI

import mpistrat

how = sys.argv[1]


class FailingTransfer(MPI.Intracomm):
    """Rank 1's second data transfer fails (the handshakes are Iallreduce: they still work)."""

    calls = 0

    def Allreduce(self, *args, **kwargs):
        FailingTransfer.calls += 1
        if how == "inside" and self.Get_rank() == 1 and FailingTransfer.calls == 2:
            raise OSError("the network card of rank 1 failed")
        return super().Allreduce(*args, **kwargs)


strategy = mpistrat.MPIStrategy(FailingTransfer(MPI.COMM_WORLD))
rank = strategy.extended.rank


def total():
    return strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(2, np.float32)))


total()
if rank == 1:
    if how == "os_exit":
        os._exit(0)
    if how in ("exit0", "create"):
        sys.exit(0)
    if how == "exit3":
        sys.exit(3)
    if how == "raise":
        raise ValueError("rank 1 gives up")
if rank == 1 and how == "skip":
    try:
        raise OSError("a file rank 1 needs is missing")
    except OSError:
        print("rank 1 skipped the all_reduce", flush=True)
elif how == "create":
    strategy = mpistrat.MPIStrategy()
else:
    total()
print(f"rank {rank} finished", flush=True)
