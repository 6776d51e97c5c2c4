"""A training job that loses ranks and goes on (Open MPI with ``--with-ft ulfm``; see
tests/distribute/test_recovery.py, which checks its result against a NumPy reference).

L1 regression with Adam over an ``ArrayDataset`` of integer features, global batch 16: each
example's gradient is a vector of small integers, so every rank's sum over its examples is exact
and divided by 16 exactly, and the optimizer's exact sum makes the weights the same bits at any
number of ranks (``--float-data``: squared error on non-integer features, which rounds). One
parameter per example (``seen``) gets that example's one-hot gradient: an example skipped or
taken twice changes it, and the test names which.

``--kill WORLD@STEP@WHERE`` (several): world rank WORLD dies with SIGKILL at optimizer step STEP:
``before`` the step's batch is read, ``inside`` the step before ``apply_gradients`` (``call2``: at
the second call of an accumulation cycle), in the ``update`` (after the gradients' sum), ``after``
the step, in a checkpoint ``save`` (sync), after an ``async`` one started, as the others
``shrink``, in ``recovery``, or at the end of the step that finds a background save written
(``poll``); ``node``: inside the step, with its parent (the node's daemon, at
virtual nodes); ``stop``: it stops for 2 s, and lives. ``--kill-once FILE``: the kills happen in a
run that does not find FILE, which it makes (a relaunch goes on). Also ``--steps N``, ``--shard``,
``--accumulate K``, ``--handler`` (the loop is ``PreemptionCheckpointHandler.run``, called as
``--handler-form``), ``--overlap`` (a generator of pairs), ``--checkpoint DIR``, ``--save-every
N``, ``--async-save``; ``--optimizer lamb``: LAMB with weight decay and clipping by the global
norm inside a dynamic loss scale; ``--nonfinite B``: the first example of global batch B has an
infinite gradient (that step is skipped, and the loss scale halves). Each survivor prints
``RESULT <world rank> <replicas> <iterations> <weights' bytes in hex>``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import numpy as np

import mpistrat
from mpistrat.checkpoint import background, saving
from mpistrat.distribute import recovery

GLOBAL_BATCH, FEATURES = 16, 3

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--kill", action="append", default=[])
parser.add_argument("--shard", action="store_true")
parser.add_argument("--accumulate", type=int, default=None)
parser.add_argument("--handler", action="store_true")
parser.add_argument("--handler-form", default="step")
parser.add_argument("--overlap", action="store_true")
parser.add_argument("--checkpoint", default=None)
parser.add_argument("--save-every", type=int, default=0)
parser.add_argument("--async-save", action="store_true")
parser.add_argument("--float-data", action="store_true")  # squared error on non-integer features
parser.add_argument("--optimizer", choices=["adam", "lamb"], default="adam")
parser.add_argument("--nonfinite", type=int, default=None)
parser.add_argument(
    "--kill-once", default=None
)  # a file: the kills happen only in a run that does not find it
args = parser.parse_args()

WORLD = mpistrat.MPI.COMM_WORLD.Get_rank()
KILLS = {(int(s), w) for r, s, w in (k.split("@") for k in args.kill) if int(r) == WORLD}
if args.kill_once and os.path.exists(args.kill_once):
    KILLS.clear()


def die_if(step: int, where: str) -> None:
    if (step, "node") in KILLS and where == "inside":  # this rank's node is lost: its daemon, then it
        print(f"NODE LOST {WORLD} at step {step}", flush=True)
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    if (step, where) in KILLS:
        print(f"DYING {WORLD} at step {step} {where}", flush=True)
        if args.kill_once:
            open(args.kill_once, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


def data(examples: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.integers(-3, 4, (examples, FEATURES)).astype(np.float32)
    y = rng.integers(-5, 6, examples).astype(np.float32)
    if (
        args.float_data
    ):  # each rank's gradient then sums rounded terms: a run at another size rounds otherwise
        x = (x + rng.standard_normal(x.shape) / 3).astype(np.float32)
    return {"x": x, "y": y, "id": np.arange(examples, dtype=np.int64)}


strategy = mpistrat.MPIStrategy(communication_options=mpistrat.CommunicationOptions(deterministic=True))
batches = args.steps + (args.nonfinite is not None)  # a skipped step reads a batch and counts none
examples = GLOBAL_BATCH * batches * (args.accumulate or 1)
dataset = mpistrat.ArrayDataset(data(examples), batch_size=GLOBAL_BATCH)


class DyingAdam(mpistrat.optimizers.Adam):
    """Adam whose update kills this rank when the job says so (after the gradients were summed)."""

    def _update_flat(self, w, g, slots, lr, step):  # type: ignore[no-untyped-def]
        die_if(step, "update")
        super()._update_flat(w, g, slots, lr, step)


class DyingLamb(mpistrat.optimizers.Lamb):
    """LAMB whose update kills this rank when the job says so (after the global norm was summed)."""

    def _update_flat(self, w, g, slots, lr, step):  # type: ignore[no-untyped-def]
        die_if(step, "update")
        super()._update_flat(w, g, slots, lr, step)


with strategy.scope():
    w = mpistrat.Variable(np.zeros(FEATURES, np.float32), name="w")
    b = mpistrat.Variable(np.zeros(1, np.float32), name="b")
    seen = mpistrat.Variable(np.zeros(examples, np.float32), name="seen")
    kept = {"shard_state": args.shard, "gradient_accumulation_steps": args.accumulate}
    if args.optimizer == "lamb":
        lamb = DyingLamb(0.05, weight_decay=0.01, global_clipnorm=0.5, **kept)
        optimizer = mpistrat.optimizers.LossScaleOptimizer(lamb, initial_scale=8.0)
    else:
        optimizer = DyingAdam(0.05, **kept)
    optimizer.build([w, b, seen])
iterator = iter(strategy.experimental_distribute_dataset(dataset))


calls = {"step": -1, "call": 0}  # the optimizer step of the last call, and the calls made at it


def train_step(batch: dict[str, np.ndarray]) -> None:
    step = int(optimizer.iterations.numpy())
    calls["call"] = calls["call"] + 1 if calls["step"] == step else 1
    calls["step"] = step
    die_if(step, "inside" if calls["call"] == 1 else f"call{calls['call']}")
    x, y, ids = batch["x"], batch["y"], batch["id"]
    wv, bv = w.numpy(), b.numpy()[0]
    sign = np.sign(x[:, 0] * wv[0] + x[:, 1] * wv[1] + x[:, 2] * wv[2] + bv - y).astype(np.float32)
    if args.float_data:
        sign = x[:, 0] * wv[0] + x[:, 1] * wv[1] + x[:, 2] * wv[2] + bv - y  # the residual: squared error
    gw = (sign @ x) / GLOBAL_BATCH
    gb = np.array([sign.sum()], np.float32) / GLOBAL_BATCH
    gs = np.zeros(examples, np.float32)
    np.add.at(gs, ids, 1.0)
    gs /= GLOBAL_BATCH
    if args.nonfinite is not None:
        gs[ids[ids == args.nonfinite * GLOBAL_BATCH]] = np.inf
    if args.optimizer == "lamb":  # the gradients of the loss times the scale (a power of 2: exact)
        scale = np.float32(optimizer.dynamic_scale.numpy())
        gw, gb, gs = gw * scale, gb * scale, gs * scale
    pairs = [(gw, w), (gb, b), (gs, seen)]
    optimizer.apply_gradients((p for p in pairs) if args.overlap else pairs)


manager = handler = None
if args.checkpoint:
    checkpoint = mpistrat.Checkpoint(model={"w": w, "b": b, "seen": seen}, optimizer=optimizer, data=iterator)
    manager = mpistrat.CheckpointManager(checkpoint, args.checkpoint, max_to_keep=2)
    if args.handler:
        handler = mpistrat.PreemptionCheckpointHandler(manager)
elif args.handler:
    raise SystemExit("--handler needs --checkpoint")

if any(where == "shrink" for _, where in KILLS):  # dies as the others revoke and shrink
    original_recover = recovery.recover

    def dying_recover(*a, **kw):  # type: ignore[no-untyped-def]
        die_if(int(optimizer.iterations.numpy()), "shrink")
        return original_recover(*a, **kw)

    recovery.recover = dying_recover
if any(where == "recovery" for _, where in KILLS):
    original = recovery._recover_on

    def dying_recovery(*a, **kw):  # type: ignore[no-untyped-def]
        die_if(int(optimizer.iterations.numpy()), "recovery")
        return original(*a, **kw)

    recovery._recover_on = dying_recovery
if any(where == "poll" for _, where in KILLS):  # dies where the others agree a background save is written
    original_poll = background.BackgroundSaves.poll

    def dying_poll(self):  # type: ignore[no-untyped-def]
        die_if(int(optimizer.iterations.numpy()), "poll")
        return original_poll(self)

    background.BackgroundSaves.poll = dying_poll
if any(where == "save" for _, where in KILLS):
    original_write = saving.write

    def dying_write(save, collectives):  # type: ignore[no-untyped-def]
        die_if(int(optimizer.iterations.numpy()), "save")
        return original_write(save, collectives)

    saving.write = dying_write


def distributed_step(batch: dict[str, np.ndarray]) -> None:
    strategy.run(train_step, args=(batch,))


def save_if_due(step: int) -> None:
    if manager is None or not args.save_every or step % args.save_every or step == 0:
        return
    options = mpistrat.CheckpointOptions(enable_async=args.async_save)
    manager.save(checkpoint_number=step, options=options)
    die_if(step, "async")


while True:
    step = int(optimizer.iterations.numpy())
    if step >= args.steps:
        break
    die_if(step, "before")
    if manager is not None:
        print(
            f"AT {step} {strategy.num_replicas_in_sync} {WORLD} LATEST {manager.latest_checkpoint}",
            flush=True,
        )
    if (step, "stop") in KILLS:  # stopped, not dead: a child wakes this rank after 2 s
        KILLS.discard((step, "stop"))
        if os.fork() == 0:
            time.sleep(2.0)
            os.kill(os.getppid(), signal.SIGCONT)
            os._exit(0)
        print(f"STOPPING {WORLD} at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        if handler is not None and args.handler_form == "run":  # as docs/preemption.md writes it
            handler.run(strategy.run, train_step, args=(next(iterator),))
        elif handler is not None:
            handler.run(distributed_step, next(iterator))
        else:
            distributed_step(next(iterator))
        die_if(step, "after")
        save_if_due(int(optimizer.iterations.numpy()))
    except mpistrat.PeerFailedError as failure:
        print(f"FAILURE {WORLD}: {failure}", flush=True)
        done = strategy.recover()
        print(f"RECOVERED {WORLD}: {done.describe()}", flush=True)

if manager is not None:
    manager.sync()
    print(f"LATEST {WORLD} {manager.latest_checkpoint}", flush=True)
weights = np.concatenate([w.numpy(), b.numpy(), seen.numpy()])
steps = int(optimizer.iterations.numpy())
print(f"RESULT {WORLD} {strategy.num_replicas_in_sync} {steps} {weights.tobytes().hex()}", flush=True)
