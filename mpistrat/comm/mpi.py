"""Thin helpers over mpi4py's buffer (upper-case) methods."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from mpi4py import MPI

from mpistrat.errors import UnsupportedTypeError

__all__ = ["mpi_datatype", "buffer_spec", "synchronize"]


@functools.cache
def mpi_datatype(dtype: np.dtype) -> MPI.Datatype:
    """The predefined MPI datatype for a NumPy dtype (reductions need a predefined one)."""
    try:
        predefined = MPI.Datatype.fromcode(dtype.char)  # public since mpi4py 4 (was MPI._typedict)
    except (ValueError, KeyError):
        predefined = MPI.DATATYPE_NULL
    if predefined != MPI.DATATYPE_NULL:
        return predefined
    raise UnsupportedTypeError(f"this MPI library has no predefined datatype for dtype {dtype}")


def buffer_spec(arr: Any, count: int | None = None) -> list[Any]:
    """``[buffer, count, datatype]`` for mpi4py, for NumPy and CuPy arrays alike.

    A CuPy array is refused unless the MPI library is known to be CUDA-aware: a device
    pointer in a host-only MPI is a segmentation fault, so this is the last guard.
    """
    if type(arr).__module__.startswith("cupy") and hasattr(type(arr), "__cuda_array_interface__"):
        from mpistrat.comm.cuda import cuda_awareness

        awareness = cuda_awareness()
        if not awareness.aware:
            raise UnsupportedTypeError(
                "a CuPy array was about to be handed to an MPI library that is not known to be "
                f"CUDA-aware ({awareness.how}); device buffers must go through "
                "mpistrat.comm.transport (which stages them through host memory)"
            )
    n = arr.size if count is None else count
    return [arr, n, mpi_datatype(arr.dtype)]


def synchronize(arrays: list[Any]) -> None:
    """Wait for the current CUDA stream if any array is on a device (MPI reads memory directly)."""
    for arr in arrays:
        if type(arr).__module__.startswith("cupy") and hasattr(type(arr), "__cuda_array_interface__"):
            import cupy

            cupy.cuda.get_current_stream().synchronize()
            return
