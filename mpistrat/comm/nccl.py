"""NCCL for device buffers: one ``cupy.cuda.nccl`` communicator per strategy.

Rank 0 creates the NCCL unique id and broadcasts it over MPI; every rank then
joins with its MPI rank, on the device that is current (the strategy's placement).
Operations are queued on the caller's current stream, so results are ready in
stream order and nothing waits on the host.

NCCL reduces int8/uint8/int32/uint32/int64/uint64/float16/float32/float64 (complex
as float pairs, which sums them componentwise); other dtypes are reduced by the
MPI transport. Gathers move raw bytes, so every dtype works; uneven gathers pad
each rank's part to the largest one.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from mpistrat.comm.base import Transport

__all__ = ["NcclTransport", "nccl_reduce_type"]

# ncclDataType_t values from nccl.h (stable), used when CuPy lacks a constant's name.
_NCCL_TYPES = {
    ("i", 1): ("NCCL_INT8", 0),
    ("u", 1): ("NCCL_UINT8", 1),
    ("i", 4): ("NCCL_INT32", 2),
    ("u", 4): ("NCCL_UINT32", 3),
    ("i", 8): ("NCCL_INT64", 4),
    ("u", 8): ("NCCL_UINT64", 5),
    ("f", 2): ("NCCL_FLOAT16", 6),
    ("f", 4): ("NCCL_FLOAT32", 7),
    ("f", 8): ("NCCL_FLOAT64", 8),
}


def nccl_reduce_type(nccl: Any, dtype: np.dtype) -> tuple[int, int] | None:
    """``(ncclDataType, elements per item)`` for summing ``dtype``, or None when NCCL cannot.

    >>> class Names:  # stands in for cupy.cuda.nccl
    ...     NCCL_FLOAT32 = 7
    >>> nccl_reduce_type(Names, np.dtype("complex64")), nccl_reduce_type(Names, np.dtype("int16"))
    ((7, 2), None)
    """
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        key, per_item = ("f", dtype.itemsize // 2), 2
    else:
        key, per_item = (dtype.kind, dtype.itemsize), 1
    if key not in _NCCL_TYPES:
        return None
    name, value = _NCCL_TYPES[key]
    return int(getattr(nccl, name, value)), per_item


class NcclTransport(Transport):
    """All-reduce and all-gather of device buffers with NCCL (collective to create)."""

    name = "nccl"

    def __init__(self, comm: MPI.Intracomm, cupy: Any):
        self.cupy = cupy
        self.nccl = importlib.import_module("cupy.cuda.nccl")
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        uid = self.nccl.get_unique_id() if self.rank == 0 else None
        uid = comm.bcast(uid, root=0)
        self.comm = self.nccl.NcclCommunicator(self.size, uid, self.rank)
        self._bytes = int(getattr(self.nccl, "NCCL_UINT8", 1))
        self._sum = int(getattr(self.nccl, "NCCL_SUM", 0))

    def supports_reduce(self, dtype: np.dtype) -> bool:
        return nccl_reduce_type(self.nccl, dtype) is not None

    def _stream(self) -> int:
        return int(self.cupy.cuda.get_current_stream().ptr)

    def allreduce(self, send: Any, recv: Any) -> None:
        datatype, per_item = self._reduce_type(recv.dtype)
        if recv.size == 0:
            return
        self.comm.allReduce(
            send.data.ptr, recv.data.ptr, recv.size * per_item, datatype, self._sum, self._stream()
        )

    def allgatherv(self, send: Any, recv: Any, counts: Sequence[int], displs: Sequence[int]) -> None:
        item = recv.dtype.itemsize
        largest = max(counts)
        if largest == 0:
            return
        stream = self._stream()
        if all(c == largest for c in counts) and all(d == r * largest for r, d in enumerate(displs)):
            self.comm.allGather(send.data.ptr, recv.data.ptr, largest * item, self._bytes, stream)
            return
        # Uneven: every rank sends `largest` items (its own, then padding), then the parts are compacted.
        block = largest * item
        padded = self.cupy.empty(block * self.size, dtype=self.cupy.uint8)
        mine = counts[self.rank] * item
        if mine:
            start = self.rank * block
            padded[start : start + mine] = send.reshape(-1).view(self.cupy.uint8)[:mine]
        base = padded.data.ptr
        self.comm.allGather(base + self.rank * block, base, block, self._bytes, stream)
        out = recv.reshape(-1).view(self.cupy.uint8)
        for r, (count, displ) in enumerate(zip(counts, displs, strict=True)):
            if count:
                out[displ * item : (displ + count) * item] = padded[r * block : r * block + count * item]

    def reduce_scatter(self, buf: Any) -> None:
        buf = buf.reshape(-1)
        per = buf.size // self.size
        if per == 0:
            return
        datatype, per_item = self._reduce_type(buf.dtype)
        # NCCL's in-place reduce-scatter writes rank r's block where it was; the caller wants it first.
        own = buf.data.ptr + self.rank * per * buf.dtype.itemsize
        self.comm.reduceScatter(buf.data.ptr, own, per * per_item, datatype, self._sum, self._stream())
        if self.rank:
            buf[:per] = buf[self.rank * per : (self.rank + 1) * per]

    def allgather(self, buf: Any) -> None:
        buf = buf.reshape(-1)
        block = (buf.size // self.size) * buf.dtype.itemsize  # whole elements, as MPI's Allgather
        if block == 0:
            return
        base = buf.data.ptr
        self.comm.allGather(base + self.rank * block, base, block, self._bytes, self._stream())

    def _reduce_type(self, dtype: np.dtype) -> tuple[int, int]:
        found = nccl_reduce_type(self.nccl, dtype)
        if found is None:
            raise TypeError(f"NCCL cannot reduce dtype {dtype}")
        return found

    def close(self) -> None:
        destroy = getattr(self.comm, "destroy", None)
        if destroy is not None:
            destroy()
