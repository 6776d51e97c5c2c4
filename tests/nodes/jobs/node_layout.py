"""Where each rank runs, as mpistrat's placement and tf's Slurm resolver see it: one JSON line per rank.

``python node_layout.py HOST:N,HOST:N...`` on the virtual nodes of that layout, with the fake
CuPy showing ``FAKE_CUPY_DEVICES`` GPUs. Each rank sets the variables ``srun`` gives a task of a
step laid out so (block distribution: the first N tasks on the first host, ...), as written by
hand from the layout, not from what MPI reports, then resolves the cluster with
``SlurmClusterResolver`` and starts a ``MultiWorkerMirroredStrategy`` on it.
"""

import json
import os
import sys

import pytest
from mpi4py import MPI

import mpistrat
from tests.support import fake_cupy

fake_cupy.install(pytest.MonkeyPatch())
layout = [(host, int(n)) for host, n in (part.split(":") for part in sys.argv[1].split(","))]
rank = MPI.COMM_WORLD.Get_rank()
strategy = mpistrat.MPIStrategy()
placement = strategy.extended.placement
report = {
    "rank": rank,
    "host": placement.host,
    "local_rank": placement.local_rank,
    "local_size": placement.local_size,
    "device": strategy.extended.worker_devices[0],
}

tasks = [(node, host) for node, (host, n) in enumerate(layout) for _ in range(n)]
os.environ.update(
    SLURM_PROCID=str(rank),
    SLURM_STEP_NUM_TASKS=str(len(tasks)),
    SLURM_STEP_NODELIST=",".join(host for host, _ in layout),
    SLURM_STEP_TASKS_PER_NODE=",".join(str(n) for _, n in layout),
    SLURM_NODEID=str(tasks[rank][0]),
    SLURMD_NODENAME=tasks[rank][1],
    CUDA_VISIBLE_DEVICES=",".join(map(str, range(int(os.environ["FAKE_CUPY_DEVICES"])))),
)
resolver = mpistrat.cluster_resolver.SlurmClusterResolver()
workers = resolver.cluster_spec().job_tasks("worker")
report["slurm_address"] = workers[rank]
report["slurm_visible"] = os.environ["CUDA_VISIBLE_DEVICES"]  # set by the resolver for this task
report["slurm_task"] = [resolver.task_type, resolver.task_id]
multi = mpistrat.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
report["replicas"] = multi.num_replicas_in_sync
print(json.dumps(report) + "\n", end="", flush=True)  # one write: lines of ranks stay whole
