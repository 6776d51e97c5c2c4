"""Which GPU a rank uses: its node-local rank modulo the devices it can see.

CuPy is imported only when placement is asked for: ``MPISTRAT_DEVICE=gpu``, or the
default ``auto`` with CuPy installed and ``CUDA_VISIBLE_DEVICES`` not empty.
``MPISTRAT_DEVICE=cpu`` never touches CUDA.

>>> choose_gpu(local_rank=5, visible=4)
1
>>> visible_from_env({"CUDA_VISIBLE_DEVICES": "2,3"})
['2', '3']
>>> device_string(3, None), device_string(3, 1)
('/job:worker/replica:0/task:3/device:CPU:0', '/job:worker/replica:0/task:3/device:GPU:1')
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from mpi4py import MPI

from mpistrat import config
from mpistrat.errors import InvalidArgumentError

__all__ = [
    "DEVICE_ENV",
    "Placement",
    "choose_gpu",
    "device_string",
    "import_cupy",
    "node_local",
    "place",
    "process_identity",
    "visible_from_env",
]

DEVICE_ENV = "MPISTRAT_DEVICE"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one rank runs.

    Attributes:
        host: this node's host name.
        local_rank, local_size: rank and size within the node (``COMM_TYPE_SHARED``).
        gpu: the CUDA device ordinal among the visible devices, or None (CPU).
        reason: why this device (or why not a GPU), for ``mpistrat info``.
        hosts: every rank's host name (``MPI.Get_processor_name()``), in rank order; empty
            where nothing was gathered (the default strategy).
        processes: every rank's :func:`process_identity`, in rank order (empty likewise).
    """

    host: str
    local_rank: int
    local_size: int
    gpu: int | None
    reason: str
    hosts: tuple[str, ...] = ()
    processes: tuple[tuple[str, int], ...] = ()

    def device(self, rank: int) -> str:
        return device_string(rank, self.gpu)


def device_string(rank: int, gpu: int | None) -> str:
    """The tf.distribute-style device name of rank ``rank``'s replica."""
    if gpu is None:
        return f"/job:worker/replica:0/task:{rank}/device:CPU:0"
    return f"/job:worker/replica:0/task:{rank}/device:GPU:{gpu}"


def choose_gpu(local_rank: int, visible: int) -> int | None:
    """The device ordinal for a node-local rank: round-robin over the visible devices."""
    return local_rank % visible if visible > 0 else None


def visible_from_env(env: Mapping[str, str]) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (None when unset; ``[]`` when it hides every GPU)."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    entries = []
    for item in value.split(","):
        item = item.strip()
        if not item or item.startswith("-"):  # CUDA stops at the first invalid entry
            break
        entries.append(item)
    return entries


def import_cupy() -> tuple[Any, str]:
    """``(cupy, "")``, or ``(None, why not)`` without raising."""
    if importlib.util.find_spec("cupy") is None:
        return None, "CuPy is not installed"
    try:
        import cupy
    except Exception as exc:  # a broken CUDA install must not break NumPy users
        return None, f"importing CuPy failed: {exc}"
    return cupy, ""


def gpu_count(cupy: Any) -> tuple[int, str]:
    """Visible CUDA devices as CuPy sees them (it honours CUDA_VISIBLE_DEVICES)."""
    try:
        return int(cupy.cuda.runtime.getDeviceCount()), ""
    except Exception as exc:
        return 0, f"CUDA reports no usable device ({exc})"


def node_local(comm: MPI.Intracomm) -> tuple[int, int]:
    """This rank's ``(rank, size)`` among the ranks of ``comm`` on the same node (collective)."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return local.Get_rank(), local.Get_size()
    finally:
        local.Free()


def requested_mode(env: Mapping[str, str]) -> str:
    return str(config.read(DEVICE_ENV, env))


def place(comm: MPI.Intracomm, env: Mapping[str, str] | None = None, *, select: bool = True) -> Placement:
    """Pick this rank's device (collective over ``comm``) and, with ``select``, make it current.

    A process selects its GPU once, with its first strategy (create that one over all
    ranks, as ``MPIStrategy()`` does); later strategies keep that device.

    With ``MPISTRAT_DEVICE=gpu`` a missing GPU on any rank raises on every rank; with
    ``auto`` that rank runs on the CPU and says why in ``Placement.reason``.
    """
    env = os.environ if env is None else env
    local_rank, local_size = node_local(comm)
    problem, placement = None, None
    try:
        placement = _place_locally(local_rank, local_size, env, select)
    except InvalidArgumentError as exc:
        problem = str(exc)
    problems: dict[str, list[int]] = {}
    # the host names and processes ride along
    gathered = comm.allgather((problem, MPI.Get_processor_name(), process_identity()))
    for r, (p, _, _) in enumerate(gathered):
        if p is not None:
            problems.setdefault(p, []).append(r)
    if problems:
        raise InvalidArgumentError("; ".join(f"{_ranks(rs)}: {p}" for p, rs in problems.items()))
    assert placement is not None
    hosts, processes = tuple(h for _, h, _ in gathered), tuple(tuple(p) for _, _, p in gathered)
    return dataclasses.replace(placement, hosts=hosts, processes=processes)


def process_identity() -> tuple[str, int]:
    """This process as another process can tell it from any other: ``(machine, pid)``, the machine
    its boot id and PID namespace (a container's own namespace is another machine; "" where they
    cannot be read). The ranks on one machine can watch each other's processes
    (``diagnostics/deaths.py``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return "", os.getpid()
    return f"{boot} {namespace}", os.getpid()


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _place_locally(local_rank: int, local_size: int, env: Mapping[str, str], select: bool) -> Placement:
    host = os.uname().nodename  # socket.gethostname()'s answer, without loading socket at every start
    mode = requested_mode(env)

    def cpu(reason: str) -> Placement:
        if mode == "gpu":
            raise InvalidArgumentError(f"{DEVICE_ENV}=gpu but {reason}; unset it to run on the CPU")
        return Placement(host, local_rank, local_size, None, reason)

    if mode == "cpu":
        return cpu(f"{DEVICE_ENV}=cpu")
    visible = visible_from_env(env)
    if visible == []:
        return cpu("CUDA_VISIBLE_DEVICES hides every GPU")
    cupy, why = import_cupy()
    if cupy is None:
        return cpu(why)
    if select and _selected.get("cupy") is cupy:  # a strategy of this process already chose
        return Placement(host, local_rank, local_size, _selected["gpu"], _selected["reason"])
    count, why = gpu_count(cupy)
    gpu = choose_gpu(local_rank, count)
    if gpu is None:
        return cpu(why or "no CUDA device is visible")
    shown = f" (CUDA_VISIBLE_DEVICES entry {visible[gpu]})" if visible and gpu < len(visible) else ""
    reason = f"node-local rank {local_rank} of {local_size} modulo {count} visible device(s){shown}"
    if select:
        cupy.cuda.Device(gpu).use()
        _selected.update(cupy=cupy, gpu=gpu, reason=f"{reason}, chosen by this process's first strategy")
    return Placement(host, local_rank, local_size, gpu, reason)


# The device this process selected, kept for later strategies (which may be over sub-communicators,
# where the node-local rank differs): arrays, streams and NCCL communicators stay on one device.
_selected: dict[str, Any] = {}


def cpu_placement(rank_in_node: int = 0, size_in_node: int = 1) -> Placement:
    """The placement of a strategy that does not place (the default strategy)."""
    return Placement(os.uname().nodename, rank_in_node, size_in_node, None, "default strategy")
