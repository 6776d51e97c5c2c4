"""A training job for tests/test_checkpoint.py, run under its own ``mpiexec``.

``python checkpoint_job.py save DIR STEPS`` trains STEPS Adam steps of the least-squares
model of tests/test_optimizers.py and saves a checkpoint in DIR (numbered by the step);
``python checkpoint_job.py restore DIR STEPS OUT`` restores the latest one, trains
STEPS more and writes what it saw (rank 0) to the JSON file OUT.
"""

import json
import sys

import numpy as np

import mpistrat
from mpistrat.optimizers import Adam
from tests.test_optimizers import X, gradients


def main(mode: str, directory: str, steps: int, out: str | None = None) -> None:
    strategy = mpistrat.MPIStrategy()
    rank, n = strategy.extended.rank, strategy.num_replicas_in_sync
    rows = np.array_split(np.arange(len(X)), n)[rank]
    with strategy.scope():
        # Before a restore, rank-dependent junk that the restore must overwrite.
        junk = 0.0 if mode == "save" else 100.0 + rank
        w = mpistrat.Variable(np.full(3, junk), name="w")
        b = mpistrat.Variable(junk, name="b")
        seen = mpistrat.Variable(0.0, synchronization="ON_READ", aggregation="SUM", name="seen")
        step = mpistrat.Variable(np.int64(0), name="step")
        opt = Adam(0.1)
    ckpt = mpistrat.Checkpoint(model={"w": w, "b": b}, optimizer=opt, step=step, seen=seen)
    manager = mpistrat.CheckpointManager(ckpt, directory, max_to_keep=1)
    report = {}
    if mode == "restore":
        path = manager.latest_checkpoint
        ckpt.restore(path).assert_consumed()
        with strategy.scope():
            report["restored"] = {"path": path, "w": w.numpy().tolist(), "seen": float(seen.numpy())}
            report["restored"]["iterations"] = int(opt.iterations.numpy())

    def train_step():
        gw, gb = gradients(w.numpy(), b.numpy(), rows)
        opt.apply_gradients([(gw, w), (gb, b)])
        seen.assign_add(float(len(rows)))

    for _ in range(steps):
        strategy.run(train_step)
        with strategy.scope():
            step.assign_add(1)
    with strategy.scope():
        if mode == "save":
            manager.save(checkpoint_number=step)
        report.update(
            w=w.numpy().tolist(),
            b=float(b.numpy()),
            step=int(step.numpy()),
            iterations=int(opt.iterations.numpy()),
            seen=float(seen.numpy()),
            ranks=n,
        )
    if out is not None and rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
