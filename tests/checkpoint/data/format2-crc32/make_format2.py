"""How ckpt-1 here was made: a format-2 checkpoint (safetensors) written by mpistrat at commit
5dac309, the last version whose entries carry CRC-32 checksums (``crc32`` in the metadata); its
header carries a CRC-32 of its own (``header_crc32``) and its dict keys holding "." are escaped.

From a checkout of that commit: ``PYTHONPATH=. mpiexec -n 2 python make_format2.py DIR``; it
writes ``DIR/ckpt-1`` and, from rank 0, the values it saved as ``DIR/ckpt-1.json``.
"""

import json
import sys

import numpy as np

import mpistrat
from mpistrat.optimizers import Adam

strategy = mpistrat.MPIStrategy()
rank = strategy.extended.rank
with strategy.scope():
    w = mpistrat.Variable(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), name="w")
    b = mpistrat.Variable(np.arange(5, dtype=np.float64), name="b")
    head = mpistrat.Variable(np.float32([0.5, -0.5]), name="head")
    step = mpistrat.Variable(np.int64(7), name="step")
    seen = mpistrat.Variable(0.0, synchronization="ON_READ", aggregation="SUM", name="seen")
    opt = Adam(0.01, shard_state=True)
data = mpistrat.ArrayDataset(np.arange(64, dtype=np.float32).reshape(32, 2), 8)
dist = strategy.experimental_distribute_dataset(data)
it = iter(dist)
next(it)
next(it)
grads = [(np.ones((3, 4), np.float32) * (rank + 1), w), (np.full(5, 0.5), b), (np.ones(2, np.float32), head)]
strategy.run(lambda: opt.apply_gradients(grads))
strategy.run(lambda: seen.assign_add(float(rank + 1)))
ckpt = mpistrat.Checkpoint(model={"w": w, "b": b, "head.b": head}, step=step, seen=seen, opt=opt, data=it)
ckpt.save(sys.argv[1] + "/ckpt")
with strategy.scope():
    values = {
        "model/w": w.numpy().tolist(),
        "model/b": b.numpy().tolist(),
        "model/head.b": head.numpy().tolist(),
        "step": int(step.numpy()),
        "seen": float(seen.numpy()),
        "opt/iterations": int(opt.iterations.numpy()),
        "slots": {
            f"{v.name}/{n}": opt.get_slot(v, n).numpy().tolist() for v in (w, b, head) for n in opt.slot_names
        },
        "save_counter": 1,
        "ranks": strategy.num_replicas_in_sync,
    }
if rank == 0:
    with open(sys.argv[1] + "/ckpt-1.json", "w") as f:
        json.dump(values, f, indent=1)
