"""What a save through ``CheckpointManager(max_to_keep=1)`` costs, deleting the file before it:

    mpiexec -n 2 python -m benchmarks.manager_save --params 16M --rounds 9

A model of ``--params`` float32 parameters in 16 variables with Adam (sharded with ``--shard``),
saved twice untimed, then ``--rounds`` timed saves, each deleting the oldest file. Between rounds,
untimed, rank 0 waits for the deleted file's removal and flushes the file systems (``os.sync``), as
in a job whose saves are minutes apart. Reported: the median and every round's time on rank 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.checkpoint import files
from mpistrat.tools.sizes import parse_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=parse_size, default=16 << 20, help="float32 parameters (default 16M)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--shard", action="store_true")
    p.add_argument(
        "--dir", default=None, help="where the files go (default: a new folder in the current one)"
    )
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    strategy = mpistrat.MPIStrategy()
    with strategy.scope():
        variables = [
            mpistrat.Variable(np.ones(args.params // 16, np.float32), name=f"layer{i:02d}") for i in range(16)
        ]
        opt = mpistrat.optimizers.Adam(1e-3, shard_state=args.shard)
        opt.build(variables)
    folder = tempfile.mkdtemp(prefix="manager-save-", dir=args.dir) if comm.rank == 0 else None
    folder = comm.bcast(folder, root=0)
    manager = mpistrat.CheckpointManager(mpistrat.Checkpoint(model=variables, opt=opt), folder, max_to_keep=1)
    manager.save()
    manager.save()
    times = []
    for _ in range(args.rounds):
        comm.Barrier()
        start = time.perf_counter()
        manager.save()
        times.append(time.perf_counter() - start)
        if comm.rank == 0:
            files.wait_for_removals()
            os.sync()
    if comm.rank == 0:
        shown = ", ".join(f"{t * 1e3:.0f}" for t in times)
        print(
            f"{comm.size} ranks, manager.save median {statistics.median(times) * 1e3:.1f} ms ({shown}); "
            f"load {os.getloadavg()[0]:.1f}"
        )
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
