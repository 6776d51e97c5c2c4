"""Where an optimizer's flat buffers lie in memory: large ones on 2 MiB boundaries, in huge pages.

An optimizer step makes a dozen passes over its flat buffers (weights, slots, the staged
gradients), each a few MiB: on 4 KiB pages every pass walks thousands of pages the TLB does not
hold. A buffer that starts on a 2 MiB boundary is made of whole transparent huge pages, where
Linux gives them: NumPy asks for them (``madvise(MADV_HUGEPAGE)``) on every allocation of 4 MiB
or more, but a buffer from ``malloc`` starts anywhere, so that its first and last 2 MiB are
4 KiB pages, and on the heap only some of it may be huge. Adam's update of 1M float32
parameters takes 1.82-1.86 ms on 2 MiB-aligned buffers, 2.08 ms on ``np.zeros`` ones (CPU time,
``python -m benchmarks.update_placement``); where the buffers start modulo 4 KiB (4K aliasing
between the streams) makes no difference there.

:func:`empty` allocates a buffer of ``LARGE`` bytes or more as a 2 MiB-aligned view of a NumPy
allocation 2 MiB longer (so ``tracemalloc`` counts it, the untouched lead-in included); smaller
ones, and device arrays, as ``xp.empty``. The view's base is a ``memoryview``, not an array, so
NumPy does not collapse the bases of its slices past it: a slice of a slice of the buffer is based
on the buffer, as with an array that owns its memory (``FlatBuffer``'s copy-on-write counts on it).
``NUMPY_MADVISE_HUGEPAGE=0`` (NumPy's switch) turns the huge pages off; the alignment stays.

>>> a = empty(1 << 21, np.float32)  # 8 MiB
>>> a.ctypes.data % HUGE_PAGE, a[2:5].base is a
(0, True)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpistrat.comm import packing

__all__ = ["HUGE_PAGE", "LARGE", "copy", "empty", "empty_like", "zeros"]

HUGE_PAGE = 2 << 20
LARGE = 4 << 20  # bytes from which NumPy asks for huge pages (and the lead-in costs at most half)


def empty(count: int, dtype: Any, xp: Any = np) -> Any:
    """An uninitialised 1-D array of ``count`` elements (``xp``: ``numpy`` or ``cupy``), 2 MiB-aligned
    when it is NumPy's and of ``LARGE`` bytes or more."""
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    if xp is not np or nbytes < LARGE:
        return xp.empty(count, dtype)
    raw = np.empty(nbytes + HUGE_PAGE, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return np.frombuffer(raw.data[start : start + nbytes], dtype)


def zeros(count: int, dtype: Any, xp: Any = np) -> Any:
    """As :func:`empty`, filled with zeros."""
    out = empty(count, dtype, xp)
    out[...] = 0
    return out


def empty_like(array: Any) -> Any:
    """:func:`empty` of ``array``'s size, dtype and array module: an update's temporary, whose
    passes cost as the buffers' do."""
    return empty(array.size, array.dtype, packing.array_module(array))


def copy(array: Any) -> Any:
    """A copy of the 1-D ``array``, placed as :func:`empty` places a new one."""
    out = empty_like(array)
    out[...] = array
    return out
