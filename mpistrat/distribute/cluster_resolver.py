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
tf's addresses are ``host:port``.

>>> expand_hostlist("node[01-04,07]")
['node01', 'node02', 'node03', 'node04', 'node07']
>>> expand_tasks_per_node("2(x3),1")
[2, 2, 2, 1]
>>> ClusterSpec({"worker": ["a:1", "b:2"]}).num_tasks("worker")
2
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from mpistrat.comm import devices
from mpistrat.errors import ContextError, InvalidArgumentError, UnsupportedTypeError

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


def _tf_config() -> dict[str, Any]:
    try:
        config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"TF_CONFIG is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidArgumentError(f"TF_CONFIG must be a JSON object; got {config!r}")
    return config


class TFConfigClusterResolver(ClusterResolver):
    """The cluster described by the ``TF_CONFIG`` environment variable, read at each call, as tf's.

    Arguments given here override ``TF_CONFIG``'s ``task`` and ``rpc_layer``.
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
    ):
        self._task_type, self._task_id = task_type, task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    @property
    def task_type(self) -> str | None:
        if self._task_type is not None:
            return str(self._task_type)
        task = _tf_config().get("task", {})
        return str(task["type"]) if "type" in task else None

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        if self._task_id is not None:
            return int(self._task_id)
        task = _tf_config().get("task", {})
        return int(task["index"]) if "index" in task else None

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        return self._rpc_layer if self._rpc_layer is not None else _tf_config().get("rpc_layer")

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str | None:
        return self._environment

    def cluster_spec(self) -> ClusterSpec:
        config = _tf_config()
        return ClusterSpec(config["cluster"]) if "cluster" in config else ClusterSpec({})

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        session_master = _tf_config().get("session_master")
        if session_master is not None:
            return str(session_master)
        spec = self.cluster_spec()
        if not spec.jobs or (len(spec.jobs) == 1 and len(spec.job_tasks(spec.jobs[0])) == 1):
            return ""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        rpc_layer = rpc_layer if rpc_layer is not None else self.rpc_layer
        if task_type is None or task_id is None:
            raise ContextError(
                "TFConfigClusterResolver.master: TF_CONFIG names no task; pass task_type and task_id"
            )
        return format_master_url(spec.task_address(task_type, task_id), rpc_layer)


# -- Slurm --------------------------------------------------------------------------------------

_PART = re.compile(r"([^\[\]]*)(\[([^\[\]]*)\])?")


def expand_hostlist(hostlist: str) -> list[str]:
    """The host names of a Slurm host list, in order, duplicates kept (as tf's and scontrol's).

    Bracket ranges keep their zero padding; a name may hold several bracket groups
    (``rack[1-2]-n[3-4]``: every combination, the last group varying fastest).

    >>> expand_hostlist("n[1-2],m5,o[3-4,6,7-9]")
    ['n1', 'n2', 'm5', 'o3', 'o4', 'o6', 'o7', 'o8', 'o9']
    >>> expand_hostlist("rack[1-2]-n[08-09]")
    ['rack1-n08', 'rack1-n09', 'rack2-n08', 'rack2-n09']
    """
    if not isinstance(hostlist, str):
        raise UnsupportedTypeError(f"expand_hostlist: expected a string; got {type(hostlist).__name__}")
    hosts: list[str] = []
    for name in _split_outside_brackets(hostlist):
        groups: list[list[str]] = []
        position = 0
        while position < len(name):
            match = _PART.match(name, position)
            if match is None or match.end() == position:
                raise InvalidArgumentError(f'Invalid hostlist format "{hostlist}": cannot parse {name!r}')
            if match.group(1):
                groups.append([match.group(1)])
            if match.group(2) is not None:
                groups.append(_expand_ranges(match.group(3), hostlist))
            position = match.end()
        hosts.extend("".join(parts) for parts in itertools.product(*groups))
    return hosts


def _split_outside_brackets(hostlist: str) -> list[str]:
    names, current, depth = [], "", 0
    for c in hostlist:
        if c == "[":
            depth += 1
            if depth > 1:
                raise InvalidArgumentError(f'Invalid hostlist format "{hostlist}": nested "["')
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise InvalidArgumentError(f'Invalid hostlist format "{hostlist}": "]" without "["')
        elif c == "," and depth == 0:
            if not current:
                raise InvalidArgumentError(f'Invalid hostlist format "{hostlist}": an empty name')
            names.append(current)
            current = ""
            continue
        current += c
    if depth:
        raise InvalidArgumentError(f'Invalid hostlist format "{hostlist}": "[" without "]"')
    if current:
        names.append(current)
    elif names:
        raise InvalidArgumentError(f'Invalid hostlist format "{hostlist}": an empty name')
    return names


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    out: list[str] = []
    for part in ranges.split(","):
        bounds = part.split("-")
        if len(bounds) == 1:
            bounds = bounds * 2
        if len(bounds) != 2 or not all(b.isdigit() for b in bounds) or int(bounds[0]) > int(bounds[1]):
            raise InvalidArgumentError(f'Invalid hostlist format "{hostlist}": invalid range {part!r}')
        width = len(bounds[0])
        out.extend(str(i).zfill(width) for i in range(int(bounds[0]), int(bounds[1]) + 1))
    return out


_TASKS = re.compile(r"(\d+)(\(x(\d+)\))?")


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Tasks on each node of a Slurm ``SLURM_TASKS_PER_NODE`` value, in node-list order (as tf's).

    >>> expand_tasks_per_node("3(x2),2,1")
    [3, 3, 2, 1]
    """
    if not isinstance(tasks_per_node, str):
        raise UnsupportedTypeError(
            f"expand_tasks_per_node: expected a string; got {type(tasks_per_node).__name__}"
        )
    result: list[int] = []
    for part in tasks_per_node.split(","):
        match = _TASKS.fullmatch(part.strip())
        if match is None:
            raise InvalidArgumentError(f'Invalid tasks-per-node list format "{tasks_per_node}": {part!r}')
        result.extend([int(match.group(1))] * int(match.group(3) or 1))
    return result


def _slurm_var(*names: str) -> str:
    """The first of ``SLURM_<name>`` that is set (a job step's before the job's)."""
    for name in names:
        value = os.environ.get(f"SLURM_{name}")
        if value is not None:
            return value
    wanted = " or ".join(f"SLURM_{n}" for n in names)
    raise ContextError(f"{wanted} not found in environment. Not running inside a SLURM step?")


def _visible_gpus() -> int:
    """GPUs on this node: ``CUDA_VISIBLE_DEVICES``'s entries, else ``nvidia-smi``'s, else 0."""
    visible = devices.visible_from_env(os.environ)
    if visible is not None:
        return len(visible)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "--list-gpus"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


class SlurmClusterResolver(ClusterResolver):
    """The cluster of the current Slurm job step, as ``tf.distribute.cluster_resolver.SlurmClusterResolver``.

    Reads ``SLURM_PROCID`` (this task's rank), ``SLURM_STEP_NUM_TASKS``,
    ``SLURM_STEP_NODELIST`` and ``SLURM_STEP_TASKS_PER_NODE`` (outside ``srun``, the job's
    ``SLURM_NTASKS``, ``SLURM_JOB_NODELIST`` and ``SLURM_TASKS_PER_NODE``). As in tf,
    ``task_type`` and ``task_id`` are set by :meth:`cluster_spec` (None before), tasks are
    numbered over the nodes sorted by name, and ports count up from ``port_base`` on each
    node. Host lists are expanded by :func:`expand_hostlist` (no ``scontrol`` call).

    Unlike tf's, it works on nodes without GPUs: ``num_accelerators()`` is then
    ``{"GPU": 0}`` and ``CUDA_VISIBLE_DEVICES`` is left alone.

    Args:
        jobs: job names to task counts (default ``{"worker": <tasks in the step>}``).
        port_base: the first port on each node (the ports mean nothing on MPI).
        gpus_per_node: GPUs on each node (default: ``CUDA_VISIBLE_DEVICES``'s count, else
            ``nvidia-smi``'s, else 0).
        gpus_per_task: GPUs per task (default: ``gpus_per_node`` // the most tasks on a node).
        tasks_per_node: an int for every node, a dict from host name to count, or None
            (the Slurm environment's).
        auto_set_gpu: set ``CUDA_VISIBLE_DEVICES`` to this task's GPUs in :meth:`cluster_spec`.
        rpc_layer: the protocol of :meth:`master`'s URL.
    """

    def __init__(
        self,
        jobs: dict[str, int] | None = None,
        port_base: int = 8888,
        gpus_per_node: int | None = None,
        gpus_per_task: int | None = None,
        tasks_per_node: int | dict[str, int] | None = None,
        auto_set_gpu: bool = True,
        rpc_layer: str = "grpc",
    ):
        self._rank = self._resolve_own_rank()
        if jobs is None:
            jobs = {"worker": self._resolve_num_tasks()}
        self._jobs = dict(jobs)
        self._port_base = int(port_base)
        if tasks_per_node is None:
            self._task_configuration = self._resolve_task_configuration()
        elif isinstance(tasks_per_node, Mapping):
            self._task_configuration = {str(h): int(n) for h, n in tasks_per_node.items()}
        else:
            self._task_configuration = {host: int(tasks_per_node) for host in self._resolve_hostlist()}
        if not self._task_configuration:
            raise ContextError("SlurmClusterResolver: the Slurm node list is empty")
        max_tasks_per_node = max(self._task_configuration.values())
        num_tasks = sum(self._task_configuration.values())
        if gpus_per_node is None:
            gpus_per_node = _visible_gpus()
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // max_tasks_per_node if max_tasks_per_node else 0
        self._gpus_per_node, self._gpus_per_task = int(gpus_per_node), int(gpus_per_task)
        self._auto_set_gpu = auto_set_gpu
        self._task_type, self._task_id = None, None
        self._rpc_layer = rpc_layer
        self._gpu_allocation: list[str] = []
        self._cluster_allocation: dict[str, list[str]] = {}
        if max_tasks_per_node * self._gpus_per_task > self._gpus_per_node:
            raise ContextError("Requested more GPUs per node than available.")
        if sum(self._jobs.values()) != num_tasks:
            raise ContextError(
                f"Requested {sum(self._jobs.values())} tasks but only {num_tasks} were assigned."
            )

    def _resolve_own_rank(self) -> int:
        return int(_slurm_var("PROCID"))

    def _resolve_num_tasks(self) -> int:
        return int(_slurm_var("STEP_NUM_TASKS", "NTASKS"))

    def _resolve_hostlist(self) -> list[str]:
        return expand_hostlist(_slurm_var("STEP_NODELIST", "JOB_NODELIST", "NODELIST"))

    def _resolve_task_configuration(self) -> dict[str, int]:
        hosts = self._resolve_hostlist()
        counts = expand_tasks_per_node(_slurm_var("STEP_TASKS_PER_NODE", "TASKS_PER_NODE"))
        if len(counts) != len(hosts):
            raise ContextError(
                f"SlurmClusterResolver: the node list names {len(hosts)} nodes but the tasks per node "
                f"{len(counts)}"
            )
        return dict(zip(hosts, counts, strict=True))

    def cluster_spec(self) -> ClusterSpec:
        """The cluster, recomputed at each call; sets ``task_type``, ``task_id`` (and the GPUs)."""
        tasks: list[str] = []
        gpus: list[str] = []
        per_task = self._gpus_per_task
        for host, count in sorted(self._task_configuration.items()):
            for offset in range(count):
                if per_task and (offset + 1) * per_task > self._gpus_per_node:
                    break  # as tf: no more tasks than the node has GPUs for
                tasks.append(f"{host}:{self._port_base + offset}")
                gpus.append(",".join(str(g) for g in range(offset * per_task, (offset + 1) * per_task)))
        self._gpu_allocation, self._cluster_allocation = gpus, {}
        start = 0
        for task_type, count in sorted(self._jobs.items()):
            self._cluster_allocation[task_type] = tasks[start : start + count]
            if start <= self._rank < start + count:
                self._task_type, self._task_id = task_type, self._rank - start
            start += count
        if self._auto_set_gpu and per_task and self._rank < len(gpus):
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus[self._rank]
        return ClusterSpec(self._cluster_allocation)

    def get_task_info(self) -> tuple[str | None, int | None]:
        """``(task_type, task_id)``; None before :meth:`cluster_spec` was called, as in tf."""
        return self._task_type, self._task_id

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        task_type = task_type if task_type is not None else self._task_type
        task_id = task_id if task_id is not None else self._task_id
        if task_type is not None and task_id is not None:
            return format_master_url(
                self.cluster_spec().task_address(task_type, task_id), rpc_layer or self._rpc_layer
            )
        return ""

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        return {"GPU": self._gpus_per_task}


# -- MPI ----------------------------------------------------------------------------------------


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
