"""Rank 1 skips a dataset step, a checkpoint save or a variable creation (the first argument);
the others time out after MPISTRAT_TIMEOUT seconds, naming rank 1."""

import os
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

import mpistrat

MPI.COMM_WORLD.Barrier()  # every rank has started: the timeout below is for the collectives, not the start
what = sys.argv[1]
strategy = mpistrat.MPIStrategy()
rank = strategy.extended.rank
with strategy.scope():
    w = mpistrat.Variable(np.zeros(2), name="w")
    data = strategy.experimental_distribute_dataset([np.arange(6.0), np.arange(6.0)])
    it = iter(data)
    next(it)  # everyone
    if rank != 1:
        if what == "dataset":
            next(it)
        elif what == "checkpoint":
            mpistrat.Checkpoint(w=w).write(os.path.join(tempfile.gettempdir(), f"skip-{os.getpid()}.npz"))
        else:
            mpistrat.Variable(np.ones(2), name="v")
time.sleep(60)  # rank 1 is busy elsewhere
