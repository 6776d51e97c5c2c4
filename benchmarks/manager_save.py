"""What a save through ``CheckpointManager(max_to_keep=1)`` costs, deleting the file before it:

    mpiexec -n 2 python -m benchmarks.manager_save --params 16M --rounds 9

The model of :mod:`benchmarks.checkpoint_rounds` (``--params`` float32 parameters in 16 variables
with Adam, sharded with ``--shard``), saved twice untimed, then ``--rounds`` timed saves, each
deleting the oldest file. After each, untimed, rank 0 waits for the deleted file's removal and
flushes the file systems (``os.sync``), as in a job whose saves are minutes apart. Reported: the
slowest rank's median and every round's time.
"""

from __future__ import annotations

import os
import shutil
import statistics

import mpistrat
from benchmarks.checkpoint_rounds import adam_checkpoint, arguments, interleaved
from mpistrat.checkpoint import files


def main() -> None:
    args = arguments(__doc__)
    model = adam_checkpoint(args)
    comm = model.comm
    manager = mpistrat.CheckpointManager(model.checkpoint, model.folder, max_to_keep=1)
    manager.save()

    def settle(_: str) -> None:
        if comm.Get_rank() == 0:
            files.wait_for_removals()
            os.sync()

    times, _ = interleaved(comm, {"manager.save": manager.save}, args.rounds, after=settle)
    if comm.Get_rank() == 0:
        seconds = times["manager.save"]
        shown = ", ".join(f"{t * 1e3:.0f}" for t in seconds)
        print(
            f"{comm.Get_size()} ranks, manager.save median {statistics.median(seconds) * 1e3:.1f} ms "
            f"({shown}); load {os.getloadavg()[0]:.1f}"
        )
        shutil.rmtree(model.folder, ignore_errors=True)


if __name__ == "__main__":
    main()
