"""A float32 training loop under a PreemptionCheckpointHandler, for tests/checkpoint/test_preemption.py.

``python preempted_training.py DIR OUT STEPS [SIGNAL WHO AT [during-save]]``: train STEPS
SGD-with-momentum steps of a least-squares model through ``handler.run`` (each step: its
slice of a global batch that depends only on the step, one all_reduce of the gradients),
saving to DIR. With SIGNAL (``USR1`` or ``TERM``), rank 0 sends it during run call AT (1-based)
to rank WHO (a number) or to every rank (``all``); with ``during-save``, rank 0 also sends
SIGTERM to every rank while it writes the checkpoint. Every rank prints
``rank <r> stopped after run call <n>`` when the handler exits it, and rank 0 writes the
final weights to OUT (``.npy``) when the loop completes.
"""

import os
import signal
import sys

import numpy as np

import mpistrat
from mpistrat.checkpoint import files as checkpoint_files

directory, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
sig, who, at = (sys.argv[4:7] + [None] * 3)[:3]
during_save = sys.argv[7:8] == ["during-save"]

strategy = mpistrat.MPIStrategy()
rank, size = strategy.extended.rank, strategy.num_replicas_in_sync
pids = strategy.extended.collectives.comm.allgather(os.getpid())
true_w = np.linspace(-1.0, 1.0, 4, dtype=np.float32)
with strategy.scope():
    w = mpistrat.Variable(np.zeros(4, np.float32), name="w")
    optimizer = mpistrat.optimizers.SGD(0.02, momentum=0.9)
    optimizer.build([w])
manager = mpistrat.CheckpointManager(
    mpistrat.Checkpoint(w=w, optimizer=optimizer), directory, max_to_keep=None
)
handler = mpistrat.PreemptionCheckpointHandler(manager)

if during_save and rank == 0:
    original = checkpoint_files._before_rename

    def signal_every_rank(tmp: str, path: str) -> None:
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        original(tmp, path)

    checkpoint_files._before_rename = signal_every_rank


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng([7, step]).standard_normal((24, 4)).astype(np.float32)
    return x, x @ true_w + np.float32(0.01) * np.float32(step % 3)


def train_step(step: int) -> None:
    if sig is not None and rank == 0 and step + 1 == int(at):
        for r in range(size) if who == "all" else [int(who)]:
            os.kill(pids[r], getattr(signal, f"SIG{sig}"))
    x, y = batch(step)
    rows = np.array_split(np.arange(len(y)), size)[rank]
    error = x[rows] @ w.numpy() - y[rows]
    grad = (x[rows].T @ error) * np.float32(2 / len(y))  # this rank's share of the global mean
    optimizer.apply_gradients([(grad, w)])


try:
    for step in range(handler.total_run_calls, steps):
        handler.run(strategy.run, train_step, args=(step,))
except SystemExit as exc:
    print(f"rank {rank} stopped after run call {handler.total_run_calls} (exit {exc.code})", flush=True)
    raise
if rank == 0:
    np.save(out, w.numpy())
print(f"rank {rank} finished {handler.total_run_calls} run calls", flush=True)
