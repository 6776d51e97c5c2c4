"""all_gather: concatenate every rank's arrays along an axis; sizes along it may differ.

The handshake's extras carry each rank's size along ``axis`` for every leaf; then one
``Allgatherv`` per dtype pack (an ``Allgather`` when every rank sends the same count).
A pack holds each rank's leaves one after another, so the result is cut apart per
(rank, leaf): O(R * L) slices.

>>> from mpi4py import MPI
>>> import numpy as np
>>> from mpistrat.collectives import Collectives
>>> Collectives(MPI.COMM_SELF.Dup()).all_gather([np.arange(2)], axis=0)
[array([0, 1])]
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from mpistrat.collectives import leaves as lv
from mpistrat.collectives import mismatch
from mpistrat.collectives.fingerprint import code_of
from mpistrat.comm import mpi, packing
from mpistrat.comm.mpi import mpi_datatype
from mpistrat.diagnostics import watchdog
from mpistrat.errors import InvalidArgumentError, MpistratError
from mpistrat.options import CommunicationImplementation, CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.collectives.state import CollectiveState

__all__ = ["all_gather"]

# A NumPy leaf whose result is at least this large is gathered straight into its result.
_DIRECT_BYTES = 1 << 20


@watchdog.collective("all_gather")
def all_gather(
    self: CollectiveState,
    value: Any,
    axis: int,
    options: CommunicationOptions | None = None,
    *,
    kind: str = "all_gather",
) -> Any:
    """Concatenate every rank's arrays along ``axis``; sizes along ``axis`` may differ."""
    if (
        options is None
        and type(value) is np.ndarray
        and type(axis) is int
        and -value.ndim <= axis < value.ndim  # a 0-d array fails here: the general path says why
        and lv.plain(value.dtype)
    ):
        return _all_gather_array(self, value, axis % value.ndim, kind)
    opts, error, arrays, axes = self.options, None, [], []
    leaves: list[Any] = []
    treespec: Any = None
    try:
        opts = self.options.merge(options)
        if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
            raise InvalidArgumentError(f"{kind}: axis must be an int; got {axis!r}")
        leaves, treespec = lv.flatten(value, self.caches.flat)
        arrays = lv.to_arrays(value, leaves, kind)
        for i, arr in enumerate(arrays):
            if arr.ndim == 0:
                problem = "all_gather needs arrays of rank >= 1 to concatenate; got a scalar"
            elif not -arr.ndim <= axis < arr.ndim:
                problem = f"axis {axis} is out of range for shape {arr.shape}"
            else:
                axes.append(int(axis) % arr.ndim)
                continue
            raise InvalidArgumentError(f"{kind}: leaf {lv.leaf_path(value, i)}: {problem}")
    except MpistratError as exc:
        error, arrays, axes = exc, [], []
    rests = [tuple(s for d, s in enumerate(a.shape) if d != ax) for a, ax in zip(arrays, axes, strict=True)]
    impl = lv.device_implementation(arrays, opts)
    leaves_key = [(packing.dtype_name(a), ax, r) for a, ax, r in zip(arrays, axes, rests, strict=True)]
    fingerprint = code_of(impl, opts.bytes_per_pack, treespec, *leaves_key, memo=self.caches.codes)
    sizes = self.agree(  # always: the sizes along axis are needed, check or not
        kind,
        fingerprint=fingerprint,
        describe=lambda: mismatch.describe(
            value, None, axis, implementation=impl, bytes_per_pack=opts.bytes_per_pack
        ),
        error=error,
        extras=[a.shape[ax] for a, ax in zip(arrays, axes, strict=True)],
    )
    out: list[Any] = [None] * len(arrays)
    totals = sizes.sum(axis=0).tolist()  # each leaf's size along axis in the result
    direct = [
        i
        for i, a in enumerate(arrays)
        # every rank decides alike: from agreed sizes, and device-ness (in the fingerprint), never
        # the array's exact type (a rank's np.memmap must not take another path than an ndarray)
        if not packing.is_device_array(a) and a.itemsize * totals[i] * math.prod(rests[i]) >= _DIRECT_BYTES
    ]
    for i in direct:
        out[i] = _allgather_direct(self, arrays[i], axes[i], sizes[:, i])
    if len(direct) < len(arrays):  # small (and device) leaves: packed, one call per dtype
        rest = [i for i in range(len(arrays)) if i not in set(direct)]
        moved = [lv.moveaxis_to_front(arrays[i], axes[i]) for i in rest]
        part: list[Any] = [None] * len(rest)
        rest_sizes = sizes if not direct else sizes[:, rest]
        for p in packing.plan_packs(moved, opts.bytes_per_pack, None, self.caches.packs):
            _allgather_pack(self, moved, p, rest_sizes, part, opts.implementation)
        for k, i in enumerate(rest):
            o, ax = part[k], axes[i]
            xp = packing.array_module(o)
            out[i] = o if ax == 0 else xp.ascontiguousarray(xp.moveaxis(o, 0, ax))
    return lv.unflatten(treespec, out)


def _all_gather_array(self: CollectiveState, x: np.ndarray, axis: int, kind: str) -> np.ndarray:
    """``all_gather`` of one plain NumPy array: the same steps, fingerprint and result without the
    nest bookkeeping (a batch gathered at every step is the common call)."""
    bpp = self.options.bytes_per_pack
    rest = x.shape[:axis] + x.shape[axis + 1 :]
    key = (packing.dtype_name(x), axis, rest)
    fingerprint = code_of(None, bpp, lv.LEAF_SPEC, key, memo=self.caches.codes)
    sizes = self.agree(
        kind,
        fingerprint=fingerprint,
        describe=lambda: mismatch.describe(x, None, axis, implementation=None, bytes_per_pack=bpp),
        extras=[x.shape[axis]],
    )
    if x.itemsize * int(sizes.sum()) * math.prod(rest) >= _DIRECT_BYTES:
        return _allgather_direct(self, x, axis, sizes[:, 0])
    moved = [lv.moveaxis_to_front(x, axis)]
    part: list[Any] = [None]
    for p in packing.plan_packs(moved, bpp, None, self.caches.packs):
        _allgather_pack(self, moved, p, sizes, part, self.options.implementation)
    gathered = part[0]
    return gathered if axis == 0 else np.ascontiguousarray(np.moveaxis(gathered, 0, axis))


def _allgather_direct(self: CollectiveState, arr: np.ndarray, axis: int, sizes: np.ndarray) -> np.ndarray:
    """One large NumPy leaf, received in place into its result: memory is the result alone.

    This rank copies its own block into the result; along axis 0 the blocks are
    contiguous and one in-place ``Allgatherv`` fills the rest; along another axis the
    ``Allgatherv`` counts in strided slabs of the result (a pack, a concatenate and a
    transpose back would cost up to three more copies of the result).
    """
    counts_along = sizes.tolist()
    starts = [0, *itertools.accumulate(counts_along[:-1])]
    shape = list(arr.shape)
    shape[axis] = int(sum(counts_along))
    out = np.empty(shape, dtype=arr.dtype)  # not pooled: the caller keeps it
    index = [slice(None)] * arr.ndim
    index[axis] = slice(starts[self.rank], starts[self.rank] + counts_along[self.rank])
    out[tuple(index)] = arr
    datatype = mpi_datatype(out.dtype)
    if axis == 0:
        inner = math.prod(shape[1:])
        counts = [n * inner for n in counts_along]
        displs = [a * inner for a in starts]
        mpi.allgatherv(self.comm, MPI.IN_PLACE, out.reshape(-1), counts, displs)  # in rounds beyond 2**31
        return out
    mpi.check_count(shape[axis], "all_gather")  # slabs along axis: one count each
    # One index along axis is a strided slab of the result; its extent, shrunk to one row of
    # the dims after axis, lets consecutive slabs interleave: one Allgatherv, counted in slabs.
    outer, after = math.prod(shape[:axis]), math.prod(shape[axis + 1 :])
    slab = datatype.Create_vector(outer, after, shape[axis] * after)
    row = slab.Create_resized(0, after * out.dtype.itemsize).Commit()
    try:
        self.comm.Allgatherv(MPI.IN_PLACE, [out, counts_along, starts, row])
    finally:
        row.Free()
        slab.Free()
    return out


def _allgather_pack(
    self: CollectiveState,
    moved: list[Any],
    p: Any,
    sizes: np.ndarray,
    out: list[Any],
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO,
) -> None:
    xp = p.module
    if len(p.indices) == 1:  # plain Python: NumPy's per-call overhead is most of a small gather
        i = p.indices[0]
        rows, inner = sizes[:, i].tolist(), math.prod(moved[i].shape[1:])
        counts = [n * inner for n in rows]
    else:  # elements[r][k]: rank r's part of the pack's k-th leaf; a rank's block is its leaves in order
        elements = sizes[:, p.indices] * np.array([math.prod(moved[i].shape[1:]) for i in p.indices])
        counts = elements.sum(axis=1).tolist()
    displs = [0, *itertools.accumulate(counts[:-1])]
    recv = packing.empty((sum(counts),), p.dtype, xp, self.caches.buffers)
    if len(p.indices) == 1 and packing.is_contiguous(moved[p.indices[0]]):
        send = moved[p.indices[0]]
    else:
        send = packing.pack(moved, p, self.caches.buffers)
    limit = mpi.COUNT_LIMIT
    if limit is not None and xp is np and recv.size > limit:  # counts or displacements beyond the limit
        mpi.allgatherv(self.comm, send.reshape(-1)[: counts[self.rank]], recv, counts, displs)
    else:
        if limit is not None:
            mpi.check_count(recv.size, "all_gather")
        self.transports.get(xp, implementation, p.dtype, "allgather").allgatherv(send, recv, counts, displs)
    if len(p.indices) == 1:
        out[i] = recv.reshape((sum(rows), *moved[i].shape[1:]))
        return
    # where each (rank, leaf) piece starts in recv: O(R * L) in all
    starts = (np.asarray(displs)[:, None] + np.cumsum(elements, axis=1) - elements).T.tolist()
    for k, i in enumerate(p.indices):
        lengths = elements[:, k].tolist()
        pieces = [recv[a : a + n] for a, n in zip(starts[k], lengths, strict=True)]
        out[i] = xp.concatenate(pieces).reshape((int(sizes[:, i].sum()), *moved[i].shape[1:]))
