"""Checkpoint faults in a job of their own, for tests/checkpoint/test_checkpoint_faults.py.

``python checkpoint_fault_job.py MODE DIR [ARGS]`` under ``mpiexec``; rank 0 prints one line per
outcome, which the test reads:

- ``save DIR N``: save a model of N float64 values as ``DIR/ckpt-1``.
- ``kill DIR``: save ckpt-1, then save again with the last rank killed while writing its share.
- ``full DIR N``: save ckpt-1, then a save of N values, sync and in the background, on a file system
  too small for it; then restore ckpt-1 and list the directory.
- ``readonly DIR``: on a read-only DIR holding ckpt-1: a save, then a restore.
- ``repeat DIR PREFIX K``: K saves with the prefix (two jobs at once in one directory).
"""

import os
import signal
import sys

import numpy as np

import mpistrat
import mpistrat.checkpoint.mpiio as mpiio

mode, directory = sys.argv[1], sys.argv[2]
strategy = mpistrat.MPIStrategy()
rank, size = strategy.extended.rank, strategy.num_replicas_in_sync


def say(*words: object) -> None:
    if rank == 0:
        print(*words, flush=True)


def model(n: int, seed: int = 0) -> tuple[mpistrat.Variable, mpistrat.Checkpoint]:
    with strategy.scope():
        v = mpistrat.Variable(np.arange(n, dtype=np.float64) + seed, name="v")
    return v, mpistrat.Checkpoint(v=v)


def failure(action: object) -> str:
    """What ``action()`` raised on this rank, as ``OSError <errno> rank-list``; 'none' if nothing."""
    try:
        action()  # type: ignore[operator]
    except OSError as exc:
        return f"OSError {exc.errno}"
    return "none"


if mode == "save":
    v, ckpt = model(int(sys.argv[3]))
    ckpt.save(os.path.join(directory, "ckpt"))
    say("saved")
elif mode == "kill":
    v, ckpt = model(20000)
    ckpt.save(os.path.join(directory, "ckpt"))
    real = mpiio.write_rounds

    def killed(*args: object) -> object:
        if rank == size - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args)  # type: ignore[arg-type]

    mpiio.write_rounds = killed
    say("saving")
    ckpt.save(os.path.join(directory, "ckpt"))
    say("not killed")
elif mode == "full":
    v, ckpt = model(16)
    ckpt.save(os.path.join(directory, "ckpt"))
    big, big_ckpt = model(int(sys.argv[3]), seed=1)
    outcomes = strategy.extended.collectives.comm.allgather(
        failure(lambda: big_ckpt.save(os.path.join(directory, "ckpt")))
    )
    say("sync:", outcomes, "counter", int(big_ckpt.save_counter))
    big_ckpt.save(os.path.join(directory, "ckpt"), options=mpistrat.CheckpointOptions(enable_async=True))
    outcomes = strategy.extended.collectives.comm.allgather(failure(big_ckpt.sync))
    say("async:", outcomes)
    with strategy.scope():
        v.assign(np.zeros(16))
        latest = mpistrat.latest_checkpoint(directory)
    ckpt.restore(latest).assert_consumed()
    with strategy.scope():
        say("restored", os.path.basename(latest), v.numpy().tolist() == list(range(16)))
    say("files", sorted(os.listdir(directory)))
elif mode == "readonly":
    v, ckpt = model(1000)
    outcomes = strategy.extended.collectives.comm.allgather(
        failure(lambda: ckpt.save(os.path.join(directory, "ckpt")))
    )
    say("save:", outcomes)
    with strategy.scope():
        v.assign(np.zeros(1000))
    ckpt.restore(os.path.join(directory, "ckpt-1")).assert_consumed()
    with strategy.scope():
        say("restored", v.numpy().tolist() == list(range(1000)))
elif mode == "repeat":
    prefix, times = sys.argv[3], int(sys.argv[4])
    v, ckpt = model(30000, seed=len(prefix))
    for _ in range(times):
        ckpt.save(os.path.join(directory, prefix))
    say("done", prefix)
