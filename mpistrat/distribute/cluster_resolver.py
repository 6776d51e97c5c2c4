"""Cluster resolvers, as ``tf.distribute.cluster_resolver``: who the workers are, and which one this is.

On MPI the launcher (``mpiexec``, ``srun``) already decided the cluster: every rank of
``MPI.COMM_WORLD`` is a worker and nothing needs to be resolved. These classes exist so
that ported code runs unchanged: it may construct a resolver, pass it to
:class:`~mpistrat.MultiWorkerMirroredStrategy` (which checks that it describes this MPI
job, then uses MPI), and read ``task_type``, ``task_id`` and ``cluster_spec()`` to decide
which worker is the chief.

- :class:`ClusterSpec`: jobs and their tasks' addresses, as ``tf.train.ClusterSpec``.
- :class:`SimpleClusterResolver`: the values given to it.
- :class:`TFConfigClusterResolver`: the ``TF_CONFIG`` environment variable.
- :class:`SlurmClusterResolver`: the Slurm step's environment (``SLURM_PROCID``, the node
  list and tasks per node, expanded by :func:`expand_hostlist` and
  :func:`expand_tasks_per_node`).
- :class:`MPIClusterResolver`: what ``strategy.cluster_resolver`` returns for an MPI
  strategy: ``task_type="worker"``, ``task_id`` the rank, one address per rank.

The addresses' ports mean nothing on MPI (no server listens on them); they exist because
tf's addresses are ``host:port``. This module is the public namespace and holds the MPI
resolver; the others live in ``resolver_base`` (the spec, the base class, the simple
resolver), ``resolver_tf_config`` and ``resolver_slurm`` (with Slurm's list formats).

>>> expand_hostlist("node[01-04,07]")
['node01', 'node02', 'node03', 'node04', 'node07']
>>> expand_tasks_per_node("2(x3),1")
[2, 2, 2, 1]
>>> ClusterSpec({"worker": ["a:1", "b:2"]}).num_tasks("worker")
2
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpistrat.distribute.resolver_base import (
    ClusterResolver,
    ClusterSpec,
    SimpleClusterResolver,
    format_master_url,
)
from mpistrat.distribute.resolver_slurm import SlurmClusterResolver, expand_hostlist, expand_tasks_per_node
from mpistrat.distribute.resolver_tf_config import TFConfigClusterResolver

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "MPIClusterResolver",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "expand_hostlist",
    "expand_tasks_per_node",
    "format_master_url",
]


class MPIClusterResolver(ClusterResolver):
    """The cluster of an MPI strategy: one ``"worker"`` task per rank of its communicator.

    ``task_id`` is the rank; ``cluster_spec()`` gives each rank's host name (from
    ``MPI.Get_processor_name()``) with a port counting up from ``port_base`` among the
    ranks on that host, so that addresses are unique. Nothing listens on those ports: MPI
    connects the ranks. ``num_accelerators()`` is ``{"GPU": 1}`` when the rank was placed on
    a GPU, else ``{}``. What ``strategy.cluster_resolver`` returns; not created directly.
    """

    def __init__(self, rank: int, hosts: Sequence[str], gpu: int | None, port_base: int = 8888):
        self._task_type, self._task_id = "worker", int(rank)
        counts: dict[str, int] = {}
        addresses = []
        for host in hosts:
            addresses.append(f"{host}:{port_base + counts.get(host, 0)}")
            counts[host] = counts.get(host, 0) + 1
        self._spec = ClusterSpec({"worker": addresses})
        self._gpu = gpu

    @property
    def task_type(self) -> str | None:
        return self._task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        raise AttributeError("an MPI strategy's task_type is 'worker': MPI decided the cluster")

    @property
    def task_id(self) -> int | None:
        return self._task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        raise AttributeError("an MPI strategy's task_id is the rank: MPI decided the cluster")

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        task_type = "worker" if task_type is None else task_type
        task_id = int(self._task_id or 0) if task_id is None else task_id
        return format_master_url(self._spec.task_address(task_type, task_id), rpc_layer or self._rpc_layer)

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        return {} if self._gpu is None else {"GPU": 1}

    def __repr__(self) -> str:
        return f"MPIClusterResolver(task_type='worker', task_id={self._task_id}, {self._spec!r})"


def worker_index(resolver: ClusterResolver) -> tuple[int | None, int, str]:
    """``(this task's index among the chief and worker tasks, their number, a problem or "")``.

    As tf's multi-worker strategy counts them: the chief (if any) first, then the workers.
    """
    spec = resolver.cluster_spec()
    jobs = spec.as_dict()
    other = sorted(set(jobs) - {"chief", "worker"})
    if other:
        return None, 0, f"the cluster has jobs {other}, which MultiWorkerMirroredStrategy does not use"
    chiefs = spec.num_tasks("chief") if "chief" in jobs else 0
    workers = spec.num_tasks("worker") if "worker" in jobs else 0
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type not in ("chief", "worker") or task_id is None:
        return None, chiefs + workers, f"its task is ({task_type!r}, {task_id!r}), not a chief or worker"
    return (task_id if task_type == "chief" else chiefs + int(task_id)), chiefs + workers, ""
