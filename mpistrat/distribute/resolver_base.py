"""The cluster's description and the resolvers that need no environment: tf's base classes.

- :class:`ClusterSpec`: jobs and their tasks' addresses, as ``tf.train.ClusterSpec``.
- :class:`ClusterResolver`: the base class every resolver derives from.
- :class:`SimpleClusterResolver`: the values given to it.
- :func:`format_master_url`: ``rpc_layer://host:port``.

The public names are :mod:`mpistrat.cluster_resolver`'s.

>>> ClusterSpec({"worker": ["a:1", "b:2"]}).num_tasks("worker")
2
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mpistrat.errors import InvalidArgumentError, UnsupportedTypeError

__all__ = ["ClusterResolver", "ClusterSpec", "SimpleClusterResolver", "format_master_url"]


def format_master_url(master: str, rpc_layer: str | None = None) -> str:
    """``rpc_layer://master``, or ``master`` without an RPC layer (tf's helper).

    >>> format_master_url("host:2222", "grpc"), format_master_url("host:2222")
    ('grpc://host:2222', 'host:2222')
    """
    return f"{rpc_layer}://{master}" if rpc_layer else master


class ClusterSpec:
    """Jobs and the network addresses of their tasks, as ``tf.train.ClusterSpec``.

    >>> spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"], "ps": {1: "p1:2222"}})
    >>> spec.jobs, spec.task_address("ps", 1), spec.job_tasks("ps")
    (['worker', 'ps'], 'p1:2222', [None, 'p1:2222'])
    >>> spec
    ClusterSpec({'ps': {1: 'p1:2222'}, 'worker': ['w0:2222', 'w1:2222']})

    Args:
        cluster: a dict from job names to a list of addresses or a dict from task
            indices to addresses, or another ``ClusterSpec``.
    """

    def __init__(self, cluster: Mapping[str, Any] | ClusterSpec):
        self._cluster_spec: dict[str, dict[int, str]] = {}
        if isinstance(cluster, ClusterSpec):  # tf copies through its ClusterDef, which sorts
            for job in sorted(cluster._cluster_spec):
                self._cluster_spec[job] = dict(sorted(cluster._cluster_spec[job].items()))
        elif isinstance(cluster, Mapping):
            for job_name, tasks in cluster.items():
                if not isinstance(job_name, str):
                    raise UnsupportedTypeError(f"Job name {job_name!r} must be bytes or unicode")
                if isinstance(tasks, (list, tuple)):
                    job_tasks = dict(enumerate(tasks))
                elif isinstance(tasks, Mapping):
                    job_tasks = {int(i): task for i, task in tasks.items()}
                else:
                    raise UnsupportedTypeError(
                        f"The tasks for job {job_name!r} must be a list or a dictionary from integers to "
                        "strings."
                    )
                for address in job_tasks.values():
                    if not isinstance(address, str):
                        raise UnsupportedTypeError(f"Task address {address!r} must be bytes or unicode")
                self._cluster_spec[job_name] = job_tasks
        else:
            raise UnsupportedTypeError(
                "`cluster` must be a dictionary mapping one or more job names to lists of network "
                "addresses, or a `ClusterSpec`"
            )

    def __bool__(self) -> bool:
        return bool(self._cluster_spec)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ClusterSpec):
            other = other._cluster_spec
        return self._cluster_spec == other

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, compared by value, as tf's

    def __repr__(self) -> str:
        items = self.as_dict()
        return "ClusterSpec({" + ", ".join(f"{k!r}: {items[k]!r}" for k in sorted(items)) + "})"

    def as_dict(self) -> dict[str, Any]:
        """Job names to a list of addresses (dense task indices) or a dict of index to address."""
        out: dict[str, Any] = {}
        for job in self.jobs:
            indices = self.task_indices(job)
            if not indices:
                out[job] = {}
            elif max(indices) + 1 == len(indices):
                out[job] = self.job_tasks(job)
            else:
                out[job] = {i: self.task_address(job, i) for i in indices}
        return out

    @property
    def jobs(self) -> list[str]:
        """The job names, in the order given."""
        return list(self._cluster_spec)

    def _job(self, job_name: str) -> dict[int, str]:
        try:
            return self._cluster_spec[job_name]
        except KeyError:
            raise InvalidArgumentError(f"No such job in cluster: {job_name!r}") from None

    def num_tasks(self, job_name: str) -> int:
        """How many tasks ``job_name`` has."""
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The task indices of ``job_name``, sorted."""
        return sorted(self._job(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of task ``task_index`` of ``job_name``."""
        job = self._job(job_name)
        try:
            return job[task_index]
        except KeyError:
            raise InvalidArgumentError(f"No task with index {task_index!r} in job {job_name!r}") from None

    def job_tasks(self, job_name: str) -> list[str | None]:
        """A list indexed by task index (None where a sparse job has no task)."""
        job = self._job(job_name)
        out: list[str | None] = [None] * (max(job) + 1 if job else 0)
        for i, task in job.items():
            out[i] = task
        return out


class ClusterResolver:
    """The base class, as ``tf.distribute.cluster_resolver.ClusterResolver``."""

    _task_type: str | None = None
    _task_id: int | None = None
    _rpc_layer: str | None = None

    def cluster_spec(self) -> ClusterSpec:
        """The cluster: every job and its tasks' addresses."""
        raise NotImplementedError

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of a task as a URL (``rpc_layer://host:port``), tf 1.x's session master."""
        raise NotImplementedError

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        """Accelerators per kind (``{"GPU": n}``) available to a task; ``{}`` for none."""
        return {}

    @property
    def environment(self) -> str | None:
        """The environment the cluster runs in (tf's ``"google"`` or ``""``)."""
        return ""

    @property
    def task_type(self) -> str | None:
        """This task's job name (``"worker"``, ``"chief"``), or None if unknown."""
        return self._task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """This task's index within its job, or None if unknown."""
        return self._task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        """The protocol of the addresses (``"grpc"``), or None."""
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer


class SimpleClusterResolver(ClusterResolver):
    """A resolver returning what it was given, as tf's.

    >>> r = SimpleClusterResolver(ClusterSpec({"worker": ["a:1", "b:2"]}), task_type="worker", task_id=1)
    >>> r.task_type, r.task_id, r.master("worker", 1, rpc_layer="grpc")
    ('worker', 1, 'grpc://b:2')
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec,
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: dict[str, int] | None = None,
        rpc_layer: str | None = None,
    ):
        if not isinstance(cluster_spec, ClusterSpec):
            raise UnsupportedTypeError("cluster_spec must be a `ClusterSpec`.")
        if not isinstance(master, str):
            raise UnsupportedTypeError("master must be a string.")
        self._cluster_spec = cluster_spec
        self._master = master
        self._task_type, self._task_id = task_type, task_id
        self._environment = environment
        self._num_accelerators = num_accelerators
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        return self._cluster_spec

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        if task_type is not None and task_id is not None:
            master = self._cluster_spec.task_address(task_type, task_id)
        else:
            master = self._master
        return format_master_url(master, rpc_layer or self._rpc_layer)

    @property
    def environment(self) -> str | None:
        return self._environment

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        return {} if self._num_accelerators is None else self._num_accelerators
