"""The transports that move one pack, and the choice between them.

A transport moves 1-D contiguous buffers of one dtype: ``allreduce`` (SUM; ``send is recv``
means in place), ``allgatherv`` (element counts and displacements per rank), ``bcast``, and the
in-place ``reduce_scatter`` / ``allgather`` of equal blocks that sharded optimizer state uses.

- ``mpi``: host (NumPy) buffers straight to MPI.
- ``cuda-aware mpi``: device buffers straight to MPI, after the current stream is synchronized.
- ``mpi (host staging)``: device buffers copied to pinned host buffers (reused across calls),
  moved by MPI, copied back on the caller's stream.
- ``nccl``: device buffers through a ``cupy.cuda.nccl`` communicator (see :mod:`.nccl`).

Which one carries a device pack follows ``CommunicationOptions.implementation``:

>>> caps = DeviceCapabilities(nccl=True, own_gpu=True, why_not_nccl="")
>>> choose_device_transport("AUTO", caps, cuda_aware=False)
('nccl', 'NCCL is available on every rank and each rank has its own GPU')
>>> choose_device_transport("RING", caps, cuda_aware=False)[0]
'staged'
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from mpistrat.comm.base import Transport
from mpistrat.comm.mpi import buffer_spec, mpi_datatype
from mpistrat.errors import InvalidArgumentError
from mpistrat.options import CommunicationImplementation

if TYPE_CHECKING:
    from mpistrat.comm.hierarchy import HierarchicalMPI

__all__ = [
    "CudaAwareMPI",
    "DeviceCapabilities",
    "HostMPI",
    "StagedMPI",
    "Transport",
    "Transports",
    "choose_device_transport",
    "device_capabilities",
    "nccl_status",
]


class HostMPI(Transport):
    """Buffers handed to MPI as they are (host memory, or device memory in a subclass)."""

    name = "mpi"

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm
        self.rank = comm.Get_rank()

    def allreduce(self, send: Any, recv: Any) -> None:
        source = MPI.IN_PLACE if send is recv else buffer_spec(_host_if_empty(send))
        self.comm.Allreduce(source, buffer_spec(_host_if_empty(recv)), op=MPI.SUM)

    def allgatherv(self, send: Any, recv: Any, counts: Sequence[int], displs: Sequence[int]) -> None:
        send, recv = _host_if_empty(send), _host_if_empty(recv)
        if counts.count(counts[0]) == len(counts):  # even sizes: plain Allgather is cheaper
            self.comm.Allgather(buffer_spec(send, counts[self.rank]), [recv, mpi_datatype(recv.dtype)])
            return
        self.comm.Allgatherv(
            buffer_spec(send, counts[self.rank]), [recv, list(counts), list(displs), mpi_datatype(recv.dtype)]
        )

    def bcast(self, buf: Any, root: int) -> None:
        self.comm.Bcast(buffer_spec(_host_if_empty(buf)), root=root)

    # With IN_PLACE, mpi4py takes an explicit count in these two as the count of one rank's block.
    def reduce_scatter(self, buf: Any) -> None:
        block = buffer_spec(_host_if_empty(buf), buf.size // self.comm.Get_size())
        self.comm.Reduce_scatter_block(MPI.IN_PLACE, block, op=MPI.SUM)

    def allgather(self, buf: Any) -> None:
        self.comm.Allgather(MPI.IN_PLACE, buffer_spec(_host_if_empty(buf), buf.size // self.comm.Get_size()))


class CudaAwareMPI(HostMPI):
    """Device buffers straight to a CUDA-aware MPI, once the current stream has finished writing them.

    MPI calls are blocking, so the results are in place when they return.
    """

    name = "cuda-aware mpi"

    def __init__(self, comm: MPI.Intracomm, cupy: Any):
        super().__init__(comm)
        self.cupy = cupy

    def allreduce(self, send: Any, recv: Any) -> None:
        self.cupy.cuda.get_current_stream().synchronize()
        super().allreduce(send, recv)

    def allgatherv(self, send: Any, recv: Any, counts: Sequence[int], displs: Sequence[int]) -> None:
        self.cupy.cuda.get_current_stream().synchronize()
        super().allgatherv(send, recv, counts, displs)

    def bcast(self, buf: Any, root: int) -> None:
        self.cupy.cuda.get_current_stream().synchronize()
        super().bcast(buf, root)

    def reduce_scatter(self, buf: Any) -> None:
        self.cupy.cuda.get_current_stream().synchronize()
        super().reduce_scatter(buf)

    def allgather(self, buf: Any) -> None:
        self.cupy.cuda.get_current_stream().synchronize()
        super().allgather(buf)


class StagedMPI(Transport):
    """Device buffers through one pinned host buffer, reused across calls (grown when needed).

    Device-to-host copies run on the current stream and complete before MPI starts;
    the host-to-device copy of the result is queued on the current stream, so work
    queued after the call sees the result. The next call waits for that copy before
    it reuses the staging buffer.
    """

    name = "mpi (host staging)"

    def __init__(self, comm: MPI.Intracomm, cupy: Any):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.cupy = cupy
        self._memory: Any = None
        self._host: np.ndarray | None = None
        self._pending: Any = None  # event after the last copy out of the staging buffer

    def staging(self, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """A pinned host array of ``nbytes`` bytes viewed as ``dtype`` (waits for its previous use)."""
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None
        if self._host is None or self._host.size < nbytes:
            size = 1 << max(20, (nbytes - 1).bit_length())
            self._memory = self.cupy.cuda.alloc_pinned_memory(size)
            self._host = np.ndarray((size,), dtype=np.uint8, buffer=self._memory)
        return self._host[:nbytes].view(dtype)

    def allreduce(self, send: Any, recv: Any) -> None:
        send, recv = send.reshape(-1), recv.reshape(-1)
        host = self.staging(recv.nbytes, recv.dtype)
        stream = self.cupy.cuda.get_current_stream()
        if host.size:
            send.get(stream=stream, out=host)
        stream.synchronize()
        self.comm.Allreduce(MPI.IN_PLACE, buffer_spec(host), op=MPI.SUM)
        if host.size:
            recv.set(host, stream=stream)
            self._pending = stream.record()

    def allgatherv(self, send: Any, recv: Any, counts: Sequence[int], displs: Sequence[int]) -> None:
        send, recv = send.reshape(-1), recv.reshape(-1)
        host = self.staging(recv.nbytes, recv.dtype)
        stream = self.cupy.cuda.get_current_stream()
        mine = host[displs[self.rank] : displs[self.rank] + counts[self.rank]]
        if mine.size:
            send[: counts[self.rank]].get(stream=stream, out=mine)
        stream.synchronize()
        self.comm.Allgatherv(MPI.IN_PLACE, [host, list(counts), list(displs), mpi_datatype(host.dtype)])
        if host.size:
            recv.set(host, stream=stream)
            self._pending = stream.record()

    def bcast(self, buf: Any, root: int) -> None:
        buf = buf.reshape(-1)
        host = self.staging(buf.nbytes, buf.dtype)
        stream = self.cupy.cuda.get_current_stream()
        if host.size and self.rank == root:
            buf.get(stream=stream, out=host)
        stream.synchronize()
        self.comm.Bcast(buffer_spec(host), root=root)
        if host.size and self.rank != root:
            buf.set(host, stream=stream)
            self._pending = stream.record()

    def reduce_scatter(self, buf: Any) -> None:
        buf = buf.reshape(-1)
        host = self.staging(buf.nbytes, buf.dtype)
        stream = self.cupy.cuda.get_current_stream()
        if host.size:
            buf.get(stream=stream, out=host)
        stream.synchronize()
        per = host.size // self.comm.Get_size()
        self.comm.Reduce_scatter_block(MPI.IN_PLACE, buffer_spec(host, per), op=MPI.SUM)
        if per:  # only this rank's block comes back: the rest of buf is left undefined
            buf[:per].set(host[:per], stream=stream)
            self._pending = stream.record()

    def allgather(self, buf: Any) -> None:
        buf = buf.reshape(-1)
        host = self.staging(buf.nbytes, buf.dtype)
        stream = self.cupy.cuda.get_current_stream()
        per = host.size // self.comm.Get_size()
        mine = slice(self.rank * per, (self.rank + 1) * per)
        if per:
            buf[mine].get(stream=stream, out=host[mine])
        stream.synchronize()
        self.comm.Allgather(MPI.IN_PLACE, buffer_spec(host, per))
        if host.size:
            buf.set(host, stream=stream)
            self._pending = stream.record()

    def close(self) -> None:
        if self._pending is not None:
            self._pending.synchronize()
        self._memory = self._host = self._pending = None


def _host_if_empty(buf: Any) -> Any:
    """A zero-size device buffer becomes a zero-size host one: no pointer for MPI to check."""
    if buf.size == 0 and not isinstance(buf, np.ndarray):
        return np.empty(0, dtype=buf.dtype)
    return buf


# -- choosing --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceCapabilities:
    """What every rank of a communicator agreed on about device transports.

    Attributes:
        nccl: every rank can use NCCL.
        own_gpu: no two ranks share a GPU (NCCL needs one GPU per rank).
        why_not_nccl: the reason NCCL cannot be used, naming a rank ("" when it can).
    """

    nccl: bool
    own_gpu: bool
    why_not_nccl: str


def nccl_status(cupy: Any) -> tuple[Any, str]:
    """``(nccl module, version)`` or ``(None, why not)``, never raising."""
    if cupy is None:
        return None, "CuPy is not installed"
    try:
        nccl = importlib.import_module("cupy.cuda.nccl")
    except Exception as exc:
        return None, f"cupy.cuda.nccl cannot be imported ({exc})"
    if not getattr(nccl, "available", True):
        return None, "this CuPy was built without NCCL"
    try:
        return nccl, version_string(int(nccl.get_version()))
    except Exception as exc:
        return None, f"the NCCL library cannot be loaded ({exc})"


def version_string(code: int) -> str:
    """NCCL's integer version as text (2.9 onwards: major*10000 + minor*100 + patch)."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def gpu_identity(cupy: Any) -> str | None:
    """Which physical GPU this rank's current device is (host and PCI bus id), or None."""
    if cupy is None:
        return None
    try:
        ordinal = int(cupy.cuda.runtime.getDevice())
    except Exception:
        return None
    try:
        bus = str(cupy.cuda.runtime.deviceGetPCIBusId(ordinal))
    except Exception:
        bus = f"visible={os.environ.get('CUDA_VISIBLE_DEVICES', '*')} ordinal={ordinal}"
    return f"{os.uname().nodename}/{bus}"


def device_capabilities(comm: MPI.Intracomm, cupy: Any) -> DeviceCapabilities:
    """Agree with every rank of ``comm`` on NCCL availability and GPU sharing (collective)."""
    nccl, why = nccl_status(cupy)
    reports = comm.allgather((nccl is not None, why, gpu_identity(cupy)))
    lacking = [(r, w) for r, (ok, w, _) in enumerate(reports) if not ok]
    owners: dict[str, list[int]] = {}
    for r, (_, _, gpu) in enumerate(reports):
        if gpu is not None:
            owners.setdefault(gpu, []).append(r)
    shared = [ranks for ranks in owners.values() if len(ranks) > 1]
    own_gpu = not shared and all(gpu is not None for _, _, gpu in reports)
    if lacking:
        why_not = f"NCCL is not available on rank {lacking[0][0]}: {lacking[0][1]}"
    elif not own_gpu:
        detail = f"ranks {shared[0]} share one GPU" if shared else "some rank has no GPU"
        why_not = f"NCCL needs one GPU per rank, but {detail}"
    else:
        why_not = ""
    return DeviceCapabilities(not lacking, own_gpu, why_not)


def choose_device_transport(
    implementation: CommunicationImplementation | str, caps: DeviceCapabilities, cuda_aware: bool
) -> tuple[str, str]:
    """``(kind, reason)`` with kind ``nccl``, ``cuda-aware`` or ``staged``; NCCL unusable raises.

    AUTO: NCCL when every rank has it and its own GPU, else CUDA-aware MPI, else staging.
    RING: CUDA-aware MPI when the library is known to be, else staging. NCCL: NCCL or an error.
    HIERARCHICAL is for host buffers: device buffers go as with RING.
    """
    implementation = CommunicationImplementation(getattr(implementation, "value", implementation))
    ring = (
        ("cuda-aware", "the MPI library is CUDA-aware")
        if cuda_aware
        else (
            "staged",
            "the MPI library is not known to be CUDA-aware, so device buffers are staged through host memory",
        )
    )
    if implementation in (CommunicationImplementation.RING, CommunicationImplementation.HIERARCHICAL):
        return ring
    usable = caps.nccl and caps.own_gpu
    if implementation is CommunicationImplementation.NCCL:
        if not usable:
            raise InvalidArgumentError(
                f"implementation=NCCL was requested: {caps.why_not_nccl}. Use "
                "CommunicationImplementation.RING or AUTO (MPI), or run one rank per GPU with "
                "CuPy's NCCL support installed"
            )
        return "nccl", "implementation=NCCL"
    if usable:
        return "nccl", "NCCL is available on every rank and each rank has its own GPU"
    return ring[0], f"{caps.why_not_nccl}; {ring[1]}"


class Transports:
    """The transports of one communicator, created on first use and kept for its lifetime.

    Host packs always go through MPI. The first device pack under AUTO or NCCL
    agrees with every rank on NCCL (a small collective; all ranks reach it together
    because they pass the same kinds of arrays, which the handshake checks).
    """

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm
        self.host = HostMPI(comm)
        self._chosen: dict[CommunicationImplementation, Transport] = {}
        self._ring: Transport | None = None
        self._nccl: Transport | None = None
        self._caps: DeviceCapabilities | None = None
        self._hierarchical: HierarchicalMPI | None = None

    def get(
        self, module: Any, implementation: CommunicationImplementation, dtype: np.dtype, op: str
    ) -> Transport:
        """The transport for one pack of arrays from ``module`` (``numpy`` or ``cupy``)."""
        if module is np:
            hierarchical = implementation is CommunicationImplementation.HIERARCHICAL and op == "allreduce"
            return self.hierarchical() if hierarchical else self.host
        if implementation not in self._chosen:
            self._chosen[implementation] = self._choose(module, implementation)
        chosen = self._chosen[implementation]
        if op in ("allreduce", "reduce_scatter") and not chosen.supports_reduce(dtype):
            return self.ring(module)  # NCCL cannot reduce this dtype; every rank decides the same
        return chosen

    def hierarchical(self) -> HierarchicalMPI:
        """Host sums within each node, between the nodes' leaders, then in the node (comm/hierarchy.py)."""
        if self._hierarchical is None:
            from mpistrat.comm.hierarchy import HierarchicalMPI  # HIERARCHICAL only

            self._hierarchical = HierarchicalMPI(self.comm)
        return self._hierarchical

    def ring(self, cupy: Any) -> Transport:
        from mpistrat.comm.cuda import cuda_awareness  # device arrays only: CuPy is here

        if self._ring is None:
            aware = cuda_awareness().aware
            self._ring = CudaAwareMPI(self.comm, cupy) if aware else StagedMPI(self.comm, cupy)
        return self._ring

    def capabilities(self, cupy: Any) -> DeviceCapabilities:
        if self._caps is None:
            self._caps = device_capabilities(self.comm, cupy)
        return self._caps

    def _choose(self, cupy: Any, implementation: CommunicationImplementation) -> Transport:
        from mpistrat.comm.cuda import cuda_awareness  # device arrays only: CuPy is here

        if implementation in (CommunicationImplementation.RING, CommunicationImplementation.HIERARCHICAL):
            return self.ring(cupy)
        kind, _ = choose_device_transport(implementation, self.capabilities(cupy), cuda_awareness().aware)
        if kind != "nccl":
            return self.ring(cupy)
        if self._nccl is None:
            from mpistrat.comm.nccl import NcclTransport

            self._nccl = NcclTransport(self.comm, cupy)
        return self._nccl

    def describe(self) -> dict[str, str]:
        """The transports chosen so far, by implementation (for ``mpistrat info`` and tests)."""
        chosen = {impl.value: t.name for impl, t in self._chosen.items()}
        return {"host": self.host.name, **chosen}

    def communicators(self) -> list[MPI.Intracomm]:
        """The sub-communicators made so far (a node's and its leaders', for HIERARCHICAL)."""
        made = self._hierarchical.made if self._hierarchical is not None else None
        return [] if made is None else [c for c in (made.node, made.leaders) if c is not None]

    def close(self) -> None:
        for transport in (self._nccl, self._ring, self._hierarchical):
            if transport is not None:
                transport.close()
        self._chosen.clear()
        self._nccl = self._ring = self._hierarchical = None
