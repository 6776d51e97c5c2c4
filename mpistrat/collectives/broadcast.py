"""broadcast: root's nest of arrays on every rank, one ``Bcast`` per dtype pack.

>>> from mpi4py import MPI
>>> import numpy as np
>>> from mpistrat.collectives import Collectives
>>> Collectives(MPI.COMM_SELF.Dup()).broadcast({"w": np.arange(3)})
{'w': array([0, 1, 2])}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat.collectives import leaves as lv
from mpistrat.collectives import mismatch
from mpistrat.collectives.fingerprint import arrays_code
from mpistrat.comm import mpi, packing
from mpistrat.diagnostics import watchdog
from mpistrat.errors import MpistratError

if TYPE_CHECKING:
    from mpistrat.collectives.state import CollectiveState

__all__ = ["broadcast"]


@watchdog.collective("broadcast")
def broadcast(
    self: CollectiveState,
    value: Any,
    root: int = 0,
    *,
    kind: str = "broadcast",
    error: MpistratError | None = None,
) -> Any:
    """Root's nest of arrays on every rank.

    Every rank passes a nest of the same structure, dtypes and shapes (checked); only
    root's contents count. The result is a copy on every rank, root too.
    """
    arrays: list[Any] = []
    leaves: list[Any] = []
    treespec: Any = None
    try:
        leaves, treespec = lv.flatten(value, self.caches.flat)
        arrays = lv.to_arrays(value, leaves, kind)
    except MpistratError as exc:
        error = error or exc
    numpy_only = arrays is leaves
    packs = None
    if numpy_only and error is None:
        fingerprint, packs = lv.numpy_plan(self.caches, None, treespec, arrays, self.options.bytes_per_pack)
    else:
        fingerprint = arrays_code(
            self.caches.codes, None, None, treespec, arrays, bytes_per_pack=self.options.bytes_per_pack
        )
    self.agree(
        kind,
        fingerprint=fingerprint,
        describe=lambda: mismatch.describe(value, None, bytes_per_pack=self.options.bytes_per_pack),
        error=error,
        deferrable=True,
    )
    if packs is None:
        packs = packing.plan_packs(arrays, self.options.bytes_per_pack, None, self.caches.packs)
    out: list[Any] = [None] * len(arrays)
    for p in packs:
        transport = self.transports.host if p.module is np else self.transports.ring(p.module)
        if len(p.indices) == 1:
            i = p.indices[0]
            if self.rank == root:
                buf = packing.array_module(arrays[i]).array(arrays[i], order="C", copy=True)
            else:
                buf = packing.empty(arrays[i].shape, p.dtype, p.module, self.caches.buffers)
            _bcast(self, buf, transport, root, kind)
            out[i] = buf
            continue
        if self.rank == root:
            buf = packing.pack(arrays, p, self.caches.buffers)
        else:
            buf = packing.empty((sum(arrays[i].size for i in p.indices),), p.dtype, p.module)
        _bcast(self, buf, transport, root, kind)
        packing.unpack(buf, arrays, p, out)
    return lv.unflatten(treespec, out if numpy_only else lv.like_leaves(leaves, out))


def _bcast(self: CollectiveState, buf: Any, transport: Any, root: int, kind: str) -> None:
    """``transport.bcast``; host buffers in pieces beyond the count limit, device ones checked against it."""
    if mpi.COUNT_LIMIT is not None:
        if type(buf) is np.ndarray:
            mpi.bcast(self.comm, buf, root)
            return
        mpi.check_count(buf.size, kind)
    transport.bcast(buf, root)
