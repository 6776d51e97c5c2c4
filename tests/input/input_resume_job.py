"""A training job for tests/input/test_input_resume.py, run under its own ``mpiexec``.

``python input_resume_job.py DIR EPOCHS STOP OUT [--pipelines] [--preemptible]`` trains a linear
model with momentum SGD on float32 data read from ``ArrayDataset(shuffle=True, seed=SEED)``, with
the dataset's position tracked by the checkpoint. It first restores the latest checkpoint in DIR
(if any), then trains up to EPOCHS epochs. STOP is ``none``, ``epoch=N`` (save after the Nth
epoch's loop has ended, then exit), ``step=N`` (save after the Nth step, then exit) or
``signal=N`` (the last rank sends itself SIGUSR1 after the Nth step); rank 0 writes the weights
and what it restored to the JSON file OUT. ``--pipelines`` reads the data with
``distribute_datasets_from_function`` (each rank a shard), else with
``experimental_distribute_dataset``. ``--preemptible`` runs the loop of docs/preemption.md: a
``PreemptionCheckpointHandler`` restores, and saves and exits (status 75) after a signal.
"""

import json
import os
import signal
import sys

import numpy as np

import mpistrat
from mpistrat.optimizers import SGD

SEED = 7
GLOBAL_BATCH = 12  # divisible by 2 and 3: per-rank pipelines batch GLOBAL_BATCH // R
LR, MOMENTUM = 0.05, 0.9
_rng = np.random.default_rng(2024)
X = _rng.normal(size=(50, 3)).astype(np.float32)
Y = (X @ np.array([1.5, -2.0, 0.5]) + 0.25 + 0.01 * _rng.normal(size=50)).astype(np.float32)


def main(directory: str, epochs: int, stop: str, out: str, pipelines: bool, preemptible: bool) -> None:
    strategy = mpistrat.MPIStrategy()
    rank, ranks = strategy.extended.rank, strategy.num_replicas_in_sync
    datasets = []

    def dataset_fn(ctx: mpistrat.InputContext) -> mpistrat.ArrayDataset:
        batch = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        ds = mpistrat.ArrayDataset((X, Y), batch, shuffle=True, seed=SEED)
        datasets.append(ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id))
        return datasets[-1]

    if pipelines:
        dist = strategy.distribute_datasets_from_function(dataset_fn)
    else:
        datasets.append(mpistrat.ArrayDataset((X, Y), GLOBAL_BATCH, shuffle=True, seed=SEED))
        dist = strategy.experimental_distribute_dataset(datasets[0])
    (dataset,) = datasets
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(3, np.float32), name="w")
        b = mpistrat.Variable(np.float32(0), name="b")
        step = mpistrat.Variable(np.int64(0), name="step")
        opt = SGD(LR, momentum=MOMENTUM)
    ckpt = mpistrat.Checkpoint(model={"w": w, "b": b}, optimizer=opt, step=step, data=dist)
    manager = mpistrat.CheckpointManager(ckpt, directory, max_to_keep=1)
    handler = None
    if preemptible:
        handler = mpistrat.PreemptionCheckpointHandler(manager)  # restores the latest checkpoint
    elif manager.latest_checkpoint is not None:
        ckpt.restore(manager.latest_checkpoint).assert_consumed()
    report = {"ranks": ranks, "start": [dataset.epoch, int(step.numpy())]}
    kind, _, number = stop.partition("=")

    def train_step(batch):
        x, y = batch
        n = mpistrat.get_replica_context().all_reduce("sum", np.float32(len(x)))
        err = x @ w.value() + b.value() - y
        opt.apply_gradients([(2 * x.T @ err / n, w), (2 * err.sum() / n, b)])

    for epoch in range(dataset.epoch, epochs):
        for batch in dist:
            strategy.run(train_step, args=(batch,))
            with strategy.scope():
                step.assign_add(1)
            if kind == "step" and int(step.numpy()) == int(number):
                manager.save()
                return
            if kind == "signal" and int(step.numpy()) == int(number) and rank == ranks - 1:
                os.kill(os.getpid(), signal.SIGUSR1)
            if handler is not None:
                handler.save_checkpoint_if_preempted()  # after the step: its batch counts as used
        if kind == "epoch" and epoch + 1 == int(number):
            manager.save()
            return
    report.update(w=w.numpy().tolist(), b=float(b.numpy()), steps=int(step.numpy()), epoch=dataset.epoch)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args[0], int(args[1]), args[2], args[3], "--pipelines" in sys.argv, "--preemptible" in sys.argv)
