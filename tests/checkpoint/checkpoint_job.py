"""A training job for tests/checkpoint/test_checkpoint.py, run under its own ``mpiexec``.

``python checkpoint_job.py save DIR STEPS`` trains STEPS Adam steps of the least-squares
model of tests/training/test_optimizers.py and saves a checkpoint in DIR (numbered by the step);
``python checkpoint_job.py restore DIR STEPS OUT`` restores the latest one, trains
STEPS more and writes what it saw (rank 0) to the JSON file OUT. ``--shard`` anywhere
builds the optimizer with ``shard_state=True``; a save given OUT writes its report too.
"""

import json
import sys

import numpy as np

import mpistrat
from mpistrat.optimizers import Adam
from tests.training.test_optimizers import X, gradients


def main(mode: str, directory: str, steps: int, out: str | None = None, shard: bool = False) -> None:
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
        opt = Adam(0.1, shard_state=shard)
    ckpt = mpistrat.Checkpoint(model={"w": w, "b": b}, optimizer=opt, step=step, seen=seen)
    manager = mpistrat.CheckpointManager(ckpt, directory, max_to_keep=1)
    report = {}
    if mode == "restore":
        path = manager.latest_checkpoint
        ckpt.restore(path).assert_consumed()
        with strategy.scope():
            report["restored"] = {"path": path, "w": w.numpy().tolist(), "seen": float(seen.numpy())}
            report["restored"]["iterations"] = int(opt.iterations.numpy())
            report["restored"]["b"] = float(b.numpy())
            report["restored"]["slots"] = _slots(opt, w, b)

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
            slots=_slots(opt, w, b),
        )
    if out is not None and rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)


def _slots(opt: Adam, *variables: mpistrat.Variable) -> dict[str, list[float]]:
    """Every slot's whole value (collective when the state is sharded)."""
    return {
        f"{v.name}/{n}": np.asarray(opt.get_slot(v, n).numpy()).reshape(-1).tolist()
        for v in variables
        for n in opt.slot_names
    }


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--shard"]
    main(args[0], args[1], int(args[2]), *args[3:], shard="--shard" in sys.argv)
