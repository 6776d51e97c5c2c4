"""A NumPy-backed stand-in for the few parts of CuPy that mpistrat uses.

It lets the device code paths (CUDA-aware MPI, pinned host staging, NCCL) run on
a machine without a GPU. It is stricter than CuPy where that catches mistakes:
no implicit conversion to NumPy, no arithmetic with NumPy arrays, ``get``/``set``
require matching shapes and dtypes. "Device" memory is host memory, so a
"CUDA-aware" MPI reads it like any buffer, and the NCCL communicator is MPI
underneath (every rank of COMM_WORLD must create theirs at the same time, as the
SPMD tests do).

Load it with :func:`install`, which registers it as ``cupy`` for one test.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import os
import random
import sys
import types
import zlib
from typing import Any

import numpy as np
from mpi4py import MPI

__version__ = "0.0.0+fake"
FAKE = True
calls: list[str] = []  # a log of stream synchronizations and NCCL calls, for tests to inspect


def install(monkeypatch: Any) -> types.ModuleType:
    """Load a fresh copy of this module as ``cupy`` (with its submodules) for one test."""
    spec = importlib.util.spec_from_file_location("cupy", __file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "cupy", module)
    monkeypatch.setitem(sys.modules, "cupy.cuda", module.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.runtime", module.cuda.runtime)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", module.cuda.nccl)
    return module


def _unwrap(x: Any, strict: bool = True) -> Any:
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray) and strict:
        raise TypeError("Unsupported type <class 'numpy.ndarray'> (fake cupy: no implicit host arrays)")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, strict) for v in x)
    return x


def _wrap(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return ndarray(x)
    if isinstance(x, np.generic):
        return ndarray(np.asarray(x))
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    return x


class _Pointer:
    def __init__(self, ptr: int):
        self.ptr = ptr


class _Flags:
    """CuPy's ``ndarray.flags``: these three, and no ``aligned`` or ``writeable``."""

    def __init__(self, flags: Any):
        self.c_contiguous, self.f_contiguous, self.owndata = (
            flags.c_contiguous,
            flags.f_contiguous,
            flags.owndata,
        )


class ndarray:
    """A device array: NumPy storage, CuPy manners."""

    __array_ufunc__ = None  # NumPy operators defer to ours, which refuse host arrays

    def __init__(self, a: np.ndarray):
        self._a = a

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    ndim = property(lambda self: self._a.ndim)
    itemsize = property(lambda self: self._a.itemsize)
    flags = property(lambda self: _Flags(self._a.flags))
    data = property(lambda self: _Pointer(self._a.ctypes.data))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self._a.__array_interface__

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._a.__dlpack_device__()

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
            "NumPy array explicitly."
        )

    def get(self, stream: Any = None, order: str = "C", out: np.ndarray | None = None, blocking: bool = True):
        if out is None:
            return np.array(self._a, order=order)
        if not isinstance(out, np.ndarray) or out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError("fake cupy: get(out=) needs a NumPy array of the same shape and dtype")
        if not out.flags.c_contiguous:
            raise RuntimeError("fake cupy: get(out=) needs a contiguous array")
        out[...] = self._a
        return out

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        if not isinstance(arr, np.ndarray):
            raise TypeError("fake cupy: set() takes a NumPy array")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError("Shape mismatch")
        self._a[...] = arr

    def __getitem__(self, key: Any) -> Any:
        return _wrap(self._a[_unwrap(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._a[_unwrap(key)] = _unwrap(value)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._a, name)
        if callable(attr):
            return lambda *a, **k: _wrap(attr(*_unwrap(a), **{n: _unwrap(v) for n, v in k.items()}))
        return _wrap(attr)

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        return (_wrap(v) for v in self._a)

    def __bool__(self) -> bool:
        return bool(self._a)

    def __int__(self) -> int:
        return int(self._a)

    def __float__(self) -> float:
        return float(self._a)

    def __repr__(self) -> str:
        return f"fake_cupy.{self._a!r}"


def _binary(name: str) -> Any:
    def op(self: ndarray, other: Any) -> Any:
        return _wrap(getattr(self._a, name)(_unwrap(other)))

    return op


def _inplace(name: str) -> Any:
    def op(self: ndarray, other: Any) -> Any:
        getattr(self._a, name)(_unwrap(other))
        return self

    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor"):
    setattr(ndarray, f"__{_name}__", _binary(f"__{_name}__"))
    setattr(ndarray, f"__r{_name}__", _binary(f"__r{_name}__"))
    setattr(ndarray, f"__i{_name}__", _inplace(f"__i{_name}__"))
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(ndarray, f"__{_name}__", _binary(f"__{_name}__"))
ndarray.__neg__ = lambda self: ndarray(-self._a)
ndarray.__hash__ = None


def asarray(a: Any, dtype: Any = None) -> ndarray:
    return ndarray(np.array(_unwrap(a, strict=False), dtype=dtype))


def array(a: Any, dtype: Any = None, copy: bool = True, order: str = "K") -> ndarray:
    return ndarray(np.array(_unwrap(a, strict=False), dtype=dtype, copy=copy, order=order))


def asnumpy(a: Any) -> np.ndarray:
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def get_array_module(*args: Any) -> Any:
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np


def __getattr__(name: str) -> Any:
    attr = getattr(np, name)
    if isinstance(attr, type) or not callable(attr):
        return attr
    return lambda *a, **k: _wrap(attr(*_unwrap(a), **{n: _unwrap(v) for n, v in k.items()}))


# -- cupy.cuda -------------------------------------------------------------------------

cuda = types.ModuleType("cupy.cuda")
runtime = types.ModuleType("cupy.cuda.runtime")
nccl = types.ModuleType("cupy.cuda.nccl")
cuda.runtime, cuda.nccl = runtime, nccl
_state = {"device": 0}


class Event:
    def __init__(self) -> None:
        self.done = False

    def synchronize(self) -> None:
        calls.append("event.synchronize")
        self.done = True


class Stream:
    ptr = 0

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.non_blocking = non_blocking

    def __enter__(self) -> Stream:
        _streams.append(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _streams.pop()

    def synchronize(self) -> None:
        calls.append("stream.synchronize")

    def record(self, event: Event | None = None) -> Event:
        return event or Event()


_streams = [Stream()]


class Device:
    def __init__(self, device: int | None = None):
        self.id = _state["device"] if device is None else int(device)

    def use(self) -> None:
        calls.append(f"device.use({self.id})")
        _state["device"] = self.id

    @property
    def pci_bus_id(self) -> str:
        return runtime.deviceGetPCIBusId(self.id)


cuda.Stream, cuda.Event, cuda.Device = Stream, Event, Device
cuda.get_current_stream = lambda: _streams[-1]
cuda.alloc_pinned_memory = lambda nbytes: bytearray(nbytes)
runtime.getDeviceCount = lambda: int(os.environ.get("FAKE_CUPY_DEVICES", "8"))
runtime.getDevice = lambda: _state["device"]
runtime.deviceGetPCIBusId = lambda i: f"0000:{i:02x}:00.0"
runtime.runtimeGetVersion = lambda: 12040
runtime.driverGetVersion = lambda: 12040

# -- cupy.cuda.nccl ----------------------------------------------------------------------

nccl.available = True
nccl.NCCL_SUM = 0
_NCCL_DTYPES = {0: "i1", 1: "u1", 2: "i4", 3: "u4", 4: "i8", 5: "u8", 6: "f2", 7: "f4", 8: "f8"}
for _code, _names in {
    0: ("NCCL_INT8", "NCCL_CHAR"),
    1: ("NCCL_UINT8",),
    2: ("NCCL_INT32", "NCCL_INT"),
    3: ("NCCL_UINT32",),
    4: ("NCCL_INT64",),
    5: ("NCCL_UINT64",),
    6: ("NCCL_FLOAT16", "NCCL_HALF"),
    7: ("NCCL_FLOAT32", "NCCL_FLOAT"),
    8: ("NCCL_FLOAT64", "NCCL_DOUBLE"),
}.items():
    for _n in _names:
        setattr(nccl, _n, _code)
nccl.get_version = lambda: 21803
_ids = itertools.count()
nccl.get_unique_id = lambda: tuple(
    random.Random(os.getpid() * 1000 + next(_ids)).randrange(256) for _ in range(128)
)


def _memory(ptr: int, nbytes: int) -> np.ndarray:
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class NcclCommunicator:
    def __init__(self, ndev: int, comm_id: tuple[int, ...], rank: int):
        color = zlib.crc32(bytes(comm_id)) % (1 << 30)
        self._comm = MPI.COMM_WORLD.Split(color, rank)
        if self._comm.Get_size() != ndev or self._comm.Get_rank() != rank:
            raise RuntimeError("fake NCCL: ranks joined with inconsistent sizes or ranks")
        self._rank, self._size = rank, ndev

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:
        calls.append("nccl.allReduce")
        assert op == nccl.NCCL_SUM
        dtype = np.dtype(_NCCL_DTYPES[datatype])
        recv = _memory(recvbuf, count * dtype.itemsize).view(dtype)
        send = MPI.IN_PLACE if sendbuf == recvbuf else _memory(sendbuf, count * dtype.itemsize).view(dtype)
        self._comm.Allreduce(send, recv, op=MPI.SUM)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
        calls.append("nccl.allGather")
        dtype = np.dtype(_NCCL_DTYPES[datatype])
        block = count * dtype.itemsize
        recv = _memory(recvbuf, block * self._size).view(dtype)
        in_place = sendbuf == recvbuf + self._rank * block
        overlaps = sendbuf < recvbuf + block * self._size and recvbuf < sendbuf + block
        assert in_place or not overlaps, "fake NCCL: overlapping buffers"
        send = MPI.IN_PLACE if in_place else _memory(sendbuf, block).view(dtype)
        self._comm.Allgather(send, recv)

    def reduceScatter(
        self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int
    ) -> None:
        calls.append("nccl.reduceScatter")
        assert op == nccl.NCCL_SUM
        dtype = np.dtype(_NCCL_DTYPES[datatype])
        block = recvcount * dtype.itemsize
        overlaps = sendbuf < recvbuf + block and recvbuf < sendbuf + block * self._size
        # NCCL's one in-place form: the receive buffer is this rank's block of the send buffer.
        assert not overlaps or recvbuf == sendbuf + self._rank * block, "fake NCCL: overlapping buffers"
        send = _memory(sendbuf, block * self._size).view(dtype).copy()
        self._comm.Reduce_scatter_block(send, _memory(recvbuf, block).view(dtype), op=MPI.SUM)

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def destroy(self) -> None:
        self._comm.Free()


nccl.NcclCommunicator = NcclCommunicator
