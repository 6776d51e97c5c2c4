"""The cluster of a Slurm job step, as tf's ``SlurmClusterResolver``, and Slurm's list formats.

:func:`expand_hostlist` and :func:`expand_tasks_per_node` read ``SLURM_*_NODELIST`` and
``SLURM_*_TASKS_PER_NODE`` (no ``scontrol`` call); :class:`SlurmClusterResolver` turns the
step's environment into a :class:`~mpistrat.cluster_resolver.ClusterSpec`. The public names
are :mod:`mpistrat.cluster_resolver`'s.

>>> expand_hostlist("node[01-04,07]")
['node01', 'node02', 'node03', 'node04', 'node07']
>>> expand_tasks_per_node("2(x3),1")
[2, 2, 2, 1]
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

from mpistrat.comm import devices
from mpistrat.distribute.resolver_base import ClusterResolver, ClusterSpec, format_master_url
from mpistrat.errors import ContextError, InvalidArgumentError, UnsupportedTypeError

__all__ = ["SlurmClusterResolver", "expand_hostlist", "expand_tasks_per_node"]


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
