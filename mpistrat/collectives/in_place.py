"""In-place transfers of one flat buffer, for a caller whose own handshake has agreed on them.

The optimizer's step opens with one handshake for all its buffers, then moves each pack
with one of these: an all-reduce (every rank updates every element), or a reduce-scatter
into equal blocks followed, after the update, by an all-gather of the blocks (sharded
state). Reduce-scatter and all-gather together move what one ring all-reduce moves.

>>> import numpy as np
>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> c = Collectives(MPI.COMM_SELF.Dup())
>>> buf = np.arange(4.0)
>>> c.all_reduce_in_place(buf); buf
array([0., 1., 2., 3.])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from mpistrat import watchdog
from mpistrat.comm import packing
from mpistrat.errors import UnsupportedTypeError

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["all_gather_in_place", "all_reduce_in_place", "reduce_scatter_in_place"]


@watchdog.collective("all_reduce")
def all_reduce_in_place(self: Collectives, buf: Any, *, kind: str = "all_reduce") -> None:
    """Sum ``buf`` across ranks into itself (host buffers to MPI, device buffers to their transport)."""
    if type(buf) is np.ndarray:
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return
    module = packing.array_module(buf)
    transport = self.transports.get(module, self.options.implementation, buf.dtype, "allreduce")
    transport.allreduce(buf, buf)


@watchdog.collective("reduce_scatter")
def reduce_scatter_in_place(self: Collectives, buf: Any, *, kind: str = "reduce_scatter") -> None:
    """Sum ``buf`` (``size`` equal blocks) across ranks; rank ``r``'s block of the sum lands at the
    start of its ``buf`` (the rest is left undefined)."""
    _host(buf, kind)
    self.comm.Reduce_scatter_block(MPI.IN_PLACE, buf, op=MPI.SUM)


@watchdog.collective("all_gather")
def all_gather_in_place(self: Collectives, buf: Any, *, kind: str = "all_gather") -> None:
    """Each rank's block ``r`` of ``buf`` (``size`` equal blocks) to every rank, in place."""
    _host(buf, kind)
    self.comm.Allgather(MPI.IN_PLACE, buf)


def _host(buf: Any, kind: str) -> None:
    if type(buf) is not np.ndarray:
        raise UnsupportedTypeError(
            f"{kind}: sharded optimizer state is supported for NumPy arrays; got a {type(buf).__module__} "
            "array. Use shard_state=False for device arrays"
        )
