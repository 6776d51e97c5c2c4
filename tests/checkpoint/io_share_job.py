"""A job for tests/checkpoint/test_checkpoint_parallel.py, run under its own ``mpiexec`` at 3, 6 and 8
ranks (sizes the suite's own runs never reach): the file bytes each rank writes in a save and reads in
a restore, counted by the kernel (``/proc/self/io``: whatever made the system calls, MPI-IO included).

``python io_share_job.py OUT DIR`` saves and restores 1M float32 parameters with Adam, unsharded,
sharded, and sharded in packs of 512 KiB (each rank's parts then many runs of the file); rank 0
writes ``{case: {"data": bytes, "header": bytes, "wrote": [per rank], "read": [per rank]}}`` to OUT.
"""

import json
import os
import sys

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.checkpoint.files import read_table


def io_counts():
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


def case(strategy, path, shard):
    with strategy.scope():
        sizes = [300_000, 1, 500_000, 248_575]  # uneven on purpose
        ws = [mpistrat.Variable(np.full(n, k + 1, np.float32), name=f"w{k}") for k, n in enumerate(sizes)]
        opt = mpistrat.optimizers.Adam(0.1, shard_state=shard)
        opt.build(ws)
    ckpt = mpistrat.Checkpoint(model=ws, opt=opt)
    ckpt.write(path)  # the first makes the folder, warms caches
    _, w0 = io_counts()
    ckpt.write(path)
    r1, w1 = io_counts()
    ckpt.read(path).assert_consumed()
    r2, _ = io_counts()
    table = read_table(path)
    data = sum(e.nbytes for e in table.entries.values())
    return {"data": data, "header": table.data_start, "wrote": w1 - w0, "read": r2 - r1}


def main(out, directory):
    world = MPI.COMM_WORLD
    results = {}
    for name, shard, pack in [("whole", False, None), ("sharded", True, None), ("packs", True, 1 << 19)]:
        options = mpistrat.CommunicationOptions(bytes_per_pack=pack) if pack else None
        strategy = mpistrat.MPIStrategy(communication_options=options)
        counted = case(strategy, os.path.join(directory, name), shard)
        gathered = world.gather(counted, root=0)
        if world.rank == 0:
            results[name] = {k: gathered[0][k] for k in ("data", "header")}
            results[name] |= {k: [g[k] for g in gathered] for k in ("wrote", "read")}
        strategy.experimental_finalize()
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
