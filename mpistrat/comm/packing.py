"""Leaves to arrays, arrays to contiguous per-dtype packs, and back.

A nest's leaves are grouped by dtype; each group is copied into one contiguous
1-D buffer (a *pack*) so a whole nest costs one MPI call per dtype. A single
contiguous array skips the copy.

>>> import numpy as np
>>> packs = plan_packs([np.ones(2, "f4"), np.ones(3, "i8"), np.ones(1, "f4")])
>>> [(p.dtype.name, p.indices) for p in packs]
[('float32', [0, 2]), ('int64', [1])]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from mpistrat.errors import UnsupportedTypeError

__all__ = [
    "Pack",
    "array_module",
    "as_array",
    "dtype_name",
    "is_device_array",
    "pack",
    "plan_packs",
    "unpack",
]

# dtype kinds that MPI can move and reduce: signed, unsigned, float, complex.
_NUMERIC_KINDS = "iufc"


def is_device_array(x: Any) -> bool:
    """Whether ``x`` is a CuPy array (checked without importing CuPy)."""
    return type(x).__module__.startswith("cupy") and hasattr(type(x), "__cuda_array_interface__")


def array_module(x: Any) -> Any:
    """``cupy`` for a CuPy array, else ``numpy``."""
    if is_device_array(x):
        import cupy

        return cupy
    return np


def dtype_name(arr: Any) -> str:
    """The dtype as shown in messages and fingerprints: ``float32``, or ``cupy:float32`` on a device."""
    return f"cupy:{arr.dtype}" if is_device_array(arr) else str(arr.dtype)


def as_array(leaf: Any, where: str = "value") -> Any:
    """The leaf as an array (NumPy or CuPy), refusing what MPI cannot carry.

    Python and NumPy scalars become 0-d NumPy arrays.
    """
    if isinstance(leaf, np.ndarray) or is_device_array(leaf):
        arr = leaf
    elif isinstance(leaf, (bool, int, float, complex, np.generic)):
        arr = np.asarray(leaf)
    else:
        raise UnsupportedTypeError(
            f"{where}: expected a NumPy/CuPy array or a Python/NumPy number; "
            f"got {type(leaf).__module__}.{type(leaf).__qualname__}"
        )
    if arr.dtype.kind not in _NUMERIC_KINDS:
        raise UnsupportedTypeError(
            f"{where}: expected a numeric dtype (int, uint, float, complex); got dtype {arr.dtype}"
        )
    return arr


@dataclasses.dataclass
class Pack:
    """Leaves (by index into the flat list) that travel together in one buffer."""

    dtype: np.dtype
    indices: list[int]
    module: Any = np


def plan_packs(arrays: list[Any], bytes_per_pack: int = 0) -> list[Pack]:
    """Group arrays by (array module, dtype), in first-seen order.

    With ``bytes_per_pack > 0`` a group is split, between leaves, into packs of
    about that many bytes; a leaf larger than that travels alone.
    """
    groups: dict[tuple[Any, np.dtype], list[int]] = {}
    for i, arr in enumerate(arrays):
        groups.setdefault((array_module(arr), arr.dtype), []).append(i)
    packs = []
    for (module, dtype), indices in groups.items():
        if bytes_per_pack <= 0:
            packs.append(Pack(dtype, indices, module))
            continue
        current: list[int] = []
        size = 0
        for i in indices:
            nbytes = arrays[i].nbytes
            if current and size + nbytes > bytes_per_pack:
                packs.append(Pack(dtype, current, module))
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            packs.append(Pack(dtype, current, module))
    return packs


def is_contiguous(arr: Any) -> bool:
    return bool(arr.flags.c_contiguous)


def pack(arrays: list[Any], p: Pack) -> Any:
    """One contiguous 1-D buffer holding the pack's leaves, always a fresh copy."""
    xp = p.module
    total = sum(arrays[i].size for i in p.indices)
    buf = xp.empty(total, dtype=p.dtype)
    offset = 0
    for i in p.indices:
        arr = arrays[i]
        n = arr.size
        buf[offset : offset + n].reshape(arr.shape)[...] = arr
        offset += n
    return buf


def unpack(buf: Any, arrays: list[Any], p: Pack, out: list[Any]) -> None:
    """Write views of ``buf`` shaped like the pack's leaves into ``out``."""
    offset = 0
    for i in p.indices:
        n = arrays[i].size
        out[i] = buf[offset : offset + n].reshape(arrays[i].shape)
        offset += n
