"""A training loop that saves in the background once, then trains on without another checkpoint call.

argv: DIRECTORY, then ``train`` (save ckpt-5 in the background after step 5, then step until killed,
printing each step) or ``resume`` (restore the newest checkpoint, print what it held). Step ``k``
leaves every weight at ``k``: a restored checkpoint says which step it was saved at.
"""

import os
import sys
import time

import numpy as np

import mpistrat

directory, mode = sys.argv[1], sys.argv[2]
strategy = mpistrat.MPIStrategy()
rank = strategy.extended.rank
with strategy.scope():
    w = mpistrat.Variable(np.zeros(4096, np.float32), name="w")
    step = mpistrat.Variable(np.int64(0), name="step")
checkpoint = mpistrat.Checkpoint(w=w, step=step)
manager = mpistrat.CheckpointManager(checkpoint, directory, max_to_keep=3)
if mode == "resume":
    checkpoint.restore(manager.latest_checkpoint).assert_consumed()
    with strategy.scope():
        print(
            f"rank {rank} restored {os.path.basename(manager.latest_checkpoint)}: step {int(step.numpy())}, "
            f"w {sorted(set(w.numpy().tolist()))}",
            flush=True,
        )
    sys.exit(0)
for k in range(1, 100000):
    total = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.float32(1)))
    with strategy.scope():
        w.assign(np.full(4096, k, np.float32))
        step.assign(np.int64(k))
    if k == 5:
        manager.save(checkpoint_number=step, options=mpistrat.CheckpointOptions(enable_async=True))
    print(f"rank {rank} step {k} ({float(total):g} ranks)", flush=True)
    time.sleep(0.05)
