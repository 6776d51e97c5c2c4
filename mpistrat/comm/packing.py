"""Leaves to arrays, arrays to contiguous per-dtype packs, and back.

A nest's leaves are grouped by dtype; each group is copied into one contiguous
1-D buffer (a *pack*) so a whole nest costs one MPI call per dtype. A single
contiguous array skips the copy.

Leaves that are all plain NumPy arrays take a fast path: the plan for a given
list of (dtype, shape) is computed once and cached with the views ``unpack``
cuts, and ``pack`` is one ``np.concatenate`` call, so a nest of many small
leaves costs microseconds, not a Python loop per leaf.

>>> import numpy as np
>>> packs = plan_packs([np.ones(2, "f4"), np.ones(3, "i8"), np.ones(1, "f4")])
>>> [(p.dtype.name, p.indices) for p in packs]
[('float32', [0, 2]), ('int64', [1])]
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import sys
from typing import Any

import numpy as np

from mpistrat.errors import UnsupportedTypeError

__all__ = [
    "Pack",
    "all_numpy",
    "array_module",
    "as_array",
    "as_arrays",
    "dtype_name",
    "empty",
    "is_device_array",
    "pack",
    "plan_packs",
    "signature",
    "unpack",
]

# dtype kinds that MPI can move and reduce: signed, unsigned, float, complex.
_NUMERIC_KINDS = "iufc"
_NUMPY_ONLY = frozenset({np.ndarray})
_DTYPE = operator.attrgetter("dtype")
_DTYPE_SHAPE = operator.attrgetter("dtype", "shape")
# Cached plans of all-NumPy leaf lists, by (bytes_per_pack, (dtype, shape)...); cleared when full.
# Large NumPy results reuse buffers handed out earlier that nobody references any more: a
# fresh allocation that size is mmap'ed, and faulting its pages in costs several times the
# Allreduce itself (2 ranks, 1 MiB: ~990 us with a fresh receive buffer, ~265 us without).
POOL_MIN_BYTES = 128 << 10
_POOL_SIZE = 4


def empty(shape: tuple[int, ...], dtype: Any, module: Any = np, pool: list[Any] | None = None) -> Any:
    """An uninitialized array, like ``module.empty``; large NumPy ones may come from ``pool``.

    ``pool`` (a strategy's ``Caches.buffers``) holds arrays this function returned before; one
    is recycled when the pool's is its only remaining reference (no caller holds it, a view of
    it, or a buffer exported from it). A recycled array is writable again: what it was handed out
    as may have been marked read-only (a variable's ``value()`` marks its own array so), and the
    caller receives into it.
    """
    if module is not np or pool is None:
        return module.empty(shape, dtype=dtype)
    if not isinstance(dtype, np.dtype):  # the collectives pass dtypes: no conversion then
        dtype = np.dtype(dtype)
    if math.prod(shape) * dtype.itemsize < POOL_MIN_BYTES:
        return np.empty(shape, dtype=dtype)
    shape = tuple(shape)
    for i in range(len(pool)):
        arr = pool[i]
        # three references: the pool's list, ``arr`` here, getrefcount's argument
        if sys.getrefcount(arr) == 3 and arr.shape == shape and arr.dtype == dtype:
            arr.flags.writeable = True  # nobody holds it: a mark of a read's is no one's any more
            pool.append(pool.pop(i))  # most recently used last
            return arr
    arr = np.empty(shape, dtype=dtype)
    if len(pool) >= _POOL_SIZE:
        pool.pop(0)
    pool.append(arr)
    return arr


def all_numpy(values: list[Any]) -> bool:
    """Whether every value is exactly a NumPy ``ndarray`` (not a subclass, not CuPy).

    >>> all_numpy([np.ones(2), np.zeros(())]), all_numpy([np.ones(2), 1.0])
    (True, False)
    """
    return _NUMPY_ONLY.issuperset(map(type, values))


def is_device_array(x: Any) -> bool:
    """Whether ``x`` is a CuPy array (checked without importing CuPy)."""
    return type(x).__module__.startswith("cupy") and hasattr(type(x), "__cuda_array_interface__")


def array_module(x: Any) -> Any:
    """``cupy`` for a CuPy array, else ``numpy``."""
    if is_device_array(x):
        import cupy

        return cupy
    return np


def common_module(values: Any) -> Any:
    """``cupy`` if any of ``values`` is a CuPy array (the rest are then copied to it), else ``numpy``."""
    for v in values:
        if is_device_array(v):
            return array_module(v)
    return np


def dtype_name(arr: Any) -> str:
    """The dtype as shown in messages and fingerprints: ``float32``, or ``cupy:float32`` on a device."""
    return _dtype_name(arr.dtype, is_device_array(arr))


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype: np.dtype, device: bool) -> str:
    return f"cupy:{dtype}" if device else str(dtype)


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
    if isinstance(arr, np.ma.MaskedArray):
        raise UnsupportedTypeError(
            f"{where}: a masked array would lose its mask; pass arr.filled(value) or arr.data"
        )
    if not arr.dtype.isnative:  # MPI reads memory in the machine's byte order
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return arr


def as_arrays(leaves: list[Any], where: str = "value") -> list[Any]:
    """``as_array`` of every leaf.

    Plain NumPy arrays of numeric dtypes pass with one check and the same list comes
    back (``as_arrays(x) is x`` tells a caller that every leaf is a NumPy array).
    """
    if all_numpy(leaves) and all(
        dt.kind in _NUMERIC_KINDS and dt.isnative for dt in set(map(_DTYPE, leaves))
    ):
        return leaves
    return [as_array(leaf, where) for leaf in leaves]


def signature(arrays: list[Any]) -> tuple[tuple[np.dtype, tuple[int, ...]], ...] | None:
    """Every array's (dtype, shape) when all are plain NumPy arrays, else None (the plans' cache key)."""
    return tuple(map(_DTYPE_SHAPE, arrays)) if all_numpy(arrays) else None


@dataclasses.dataclass
class Pack:
    """Leaves (by index into the flat list) that travel together in one buffer.

    ``views`` (cached plans only): ``(index, slice, shape)`` per leaf, ``shape`` None
    where the slice already has the leaf's shape; ``size`` the pack's element count;
    ``slices`` the slices alone when the pack holds every leaf, each already shaped.
    """

    dtype: np.dtype
    indices: list[int]
    module: Any = np
    views: tuple[tuple[int, slice, tuple[int, ...] | None], ...] = ()
    size: int = -1
    slices: tuple[slice, ...] = ()


def plan_packs(
    arrays: list[Any], bytes_per_pack: int = 0, sig: tuple[Any, ...] | None = None, memo: Any = None
) -> list[Pack]:
    """Group arrays by (array module, dtype), in first-seen order.

    With ``bytes_per_pack > 0`` a group is split, between leaves, into packs of
    about that many bytes; a leaf larger than that travels alone. For plain NumPy
    arrays and a ``memo`` (a strategy's ``Caches.packs``) the plan is remembered and shared:
    callers must not modify it. ``sig``: ``signature(arrays)`` if the caller has it already.
    """
    if memo is None:
        return _plan(arrays, bytes_per_pack)
    if sig is None:
        sig = signature(arrays)
        if sig is None:
            return _plan(arrays, bytes_per_pack)
    key = (bytes_per_pack, sig)
    packs = memo.get(key)
    if packs is None:
        packs = memo.keep(key, [_with_views(p, arrays) for p in _plan(arrays, bytes_per_pack)])
    return packs


def _with_views(p: Pack, arrays: list[Any]) -> Pack:
    views, offset = [], 0
    for i in p.indices:
        n, shape = arrays[i].size, arrays[i].shape
        views.append((i, slice(offset, offset + n), None if shape == (n,) else shape))
        offset += n
    whole = len(p.indices) == len(arrays) and all(shape is None for _, _, shape in views)
    slices = tuple(part for _, part, _ in views) if whole else ()
    return dataclasses.replace(p, views=tuple(views), size=offset, slices=slices)


def _plan(arrays: list[Any], bytes_per_pack: int) -> list[Pack]:
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
    """Whether MPI can read ``arr`` as it is: C-contiguous and aligned.

    An unaligned array (``np.frombuffer(buf, offset=1)``) is contiguous, but mpi4py maps its
    buffer format (``'=d'``) to no MPI datatype (a raw ``KeyError``): it goes through ``pack``,
    whose copy is aligned, like any non-contiguous leaf. CuPy's flags say nothing of alignment:
    a device array's pointer is asked instead.
    """
    flags = arr.flags
    if not flags.c_contiguous:
        return False
    aligned = getattr(flags, "aligned", None)
    return bool(aligned) if aligned is not None else arr.data.ptr % arr.dtype.itemsize == 0


def pack(arrays: list[Any], p: Pack, pool: list[Any] | None = None) -> Any:
    """One contiguous 1-D buffer holding the pack's leaves, always a fresh copy."""
    if p.views:  # NumPy: one C loop over the leaves, each flattened in C order
        leaves = arrays if len(p.indices) == len(arrays) else [arrays[i] for i in p.indices]
        return np.concatenate(leaves, axis=None, out=empty((p.size,), p.dtype, np, pool))
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
    if p.slices:  # every leaf, all 1-D: the slices are the leaves
        out[:] = map(buf.__getitem__, p.slices)
        return
    if p.views:
        for i, part, shape in p.views:
            out[i] = buf[part] if shape is None else buf[part].reshape(shape)
        return
    offset = 0
    for i in p.indices:
        n = arrays[i].size
        out[i] = buf[offset : offset + n].reshape(arrays[i].shape)
        offset += n
