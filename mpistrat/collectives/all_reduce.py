"""all_reduce: sum (or mean) a nest of arrays across ranks, one ``Allreduce`` per dtype pack.

>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> Collectives(MPI.COMM_SELF.Dup()).all_reduce("mean", {"a": 1, "b": [40, 1]})
{'a': np.float64(1.0), 'b': [np.float64(40.0), np.float64(1.0)]}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import optree
from mpi4py import MPI

from mpistrat import mismatch, watchdog
from mpistrat.collectives import leaves as lv
from mpistrat.comm import packing
from mpistrat.errors import MpistratError
from mpistrat.options import CommunicationImplementation, CommunicationOptions
from mpistrat.reduce_op import ReduceOp

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["all_reduce", "allreduce_arrays"]


@watchdog.collective("all_reduce")
def all_reduce(
    self: Collectives,
    reduce_op: ReduceOp | str,
    value: Any,
    options: CommunicationOptions | None = None,
    *,
    kind: str = "all_reduce",
    error: MpistratError | None = None,
) -> Any:
    """Reduce a nest of arrays/numbers across ranks; same structure, dtype (SUM) out.

    ``error``: a bad-input error the caller found on this rank; it is raised on every
    rank (through the handshake) instead of stranding the others in the collective.
    """
    if options is None and error is None and type(value) is np.ndarray and lv.plain(value.dtype):
        op = lv.known_reduce_op(reduce_op)
        if op is not None:
            return _all_reduce_array(self, op, value, kind)
    opts, op, arrays = self.options, None, []
    leaves: list[Any] = []
    treespec: Any = None
    try:
        opts = self.options.merge(options)
        op = lv.reduce_op(reduce_op)
        leaves, treespec = lv.flatten(value, self.caches.flat)
        arrays = lv.to_arrays(value, leaves, kind)
    except MpistratError as exc:
        error = error or exc
    numpy_only = arrays is leaves  # to_arrays passes lists of plain NumPy arrays through
    packs = None
    impl = None if numpy_only else lv.device_implementation(arrays, opts)
    if numpy_only and error is None:
        fingerprint, packs = lv.numpy_plan(self.caches, op, treespec, arrays, opts.bytes_per_pack)
    else:
        fingerprint = lv.fingerprint(
            self.caches.codes, op, impl, treespec, arrays, bytes_per_pack=opts.bytes_per_pack
        )
    self.agree(
        kind,
        fingerprint=fingerprint,
        describe=lambda: mismatch.describe(
            value, op, implementation=impl, bytes_per_pack=opts.bytes_per_pack
        ),
        error=error,
        options=opts,
    )
    divisor = self.size if op is ReduceOp.MEAN else None
    out = allreduce_arrays(self, arrays, opts.bytes_per_pack, opts.implementation, divisor, packs)
    return optree.tree_unflatten(treespec, out if numpy_only else lv.like_leaves(leaves, out))


def _all_reduce_array(self: Collectives, op: ReduceOp, x: np.ndarray, kind: str) -> np.ndarray:
    """``all_reduce`` of one plain NumPy array: the same steps without the nest bookkeeping."""
    fingerprint, packs = lv.numpy_plan(self.caches, op, lv.LEAF_SPEC, [x], self.options.bytes_per_pack)
    bpp = self.options.bytes_per_pack
    self.agree(kind, fingerprint=fingerprint, describe=lambda: mismatch.describe(x, op, bytes_per_pack=bpp))
    divisor = self.size if op is ReduceOp.MEAN else None
    return allreduce_arrays(self, [x], 0, self.options.implementation, divisor, packs)[0]


def allreduce_arrays(
    self: Collectives,
    arrays: list[Any],
    bytes_per_pack: int,
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO,
    divisor: int | None = None,
    packs: list[packing.Pack] | None = None,
) -> list[Any]:
    """Sum across ranks, one transport call per pack; ``divisor`` divides each pack once (MEAN).

    ``packs``: the cached plan for plain NumPy ``arrays`` if the caller has it.
    """
    if packs is None:
        packs = packing.plan_packs(arrays, bytes_per_pack, None, self.caches.packs)
    out: list[Any] = [None] * len(arrays)
    for p in packs:
        # Host arrays go straight to MPI (it reads their type); device arrays pick a transport.
        host = p.module is np
        transport: Any = None if host else self.transports.get(p.module, implementation, p.dtype, "allreduce")
        if len(p.indices) == 1 and packing.is_contiguous(arrays[p.indices[0]]):
            i = p.indices[0]
            recv = packing.empty(arrays[i].shape, p.dtype, p.module, self.caches.buffers)
            if host:
                self.comm.Allreduce(arrays[i], recv, op=MPI.SUM)
            else:
                transport.allreduce(arrays[i], recv)
            out[i] = recv if divisor is None else lv.divide(recv, divisor)
        else:
            buf = packing.pack(arrays, p, self.caches.buffers)
            if host:
                self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            else:
                transport.allreduce(buf, buf)
            packing.unpack(buf if divisor is None else lv.divide(buf, divisor), arrays, p, out)
    return out
