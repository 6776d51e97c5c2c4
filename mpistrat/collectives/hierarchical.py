"""Compressed sums with ``CommunicationImplementation.HIERARCHICAL``: 16 bits between nodes only.

Within each node the ranks' values are summed in their own dtype (``Reduce`` to the node's
leader, shared memory); the leaders sum the node sums with 16-bit values on the wire
(``compressed.compressed_sum`` over the leaders: one ``Alltoall`` and one ``Allgather``, float32
accumulation); each leader broadcasts the total to its node. So the links between nodes carry
half the bytes of a float32 all-reduce between the leaders, and each value is rounded to 16 bits
twice at most, as a node sum and as part of a block sum; a job on one node sends nothing between
nodes and rounds nothing. The error bound is docs/concepts.md's with N, the number of nodes, in
place of R, over the node sums, plus the float sums within nodes.

An error of the leaders' leg (fp16 overflow) rides in the broadcast, so every rank raises it.

>>> import numpy as np
>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> c = Collectives(MPI.COMM_SELF.Dup())
>>> compressed_sum(c, np.array([1.0, 1.0 + 2**-9], np.float32), "bf16", False, "all_reduce").tolist()
[1.0, 1.001953125]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mpistrat.collectives import compressed
from mpistrat.comm import mpi
from mpistrat.comm.hierarchy import reduce_to_leader
from mpistrat.errors import InvalidArgumentError

if TYPE_CHECKING:
    from mpistrat.collectives.ranks import Ranks

__all__ = ["compressed_sum"]


def compressed_sum(self: Ranks, x: np.ndarray, codec: str, mean: bool, where: str) -> np.ndarray:
    """The sum (MEAN: average) over every rank of the 1-D host array ``x``, 16-bit between nodes.

    Collective over the strategy's ranks. Returns a new array of ``x``'s dtype.
    """
    h = self.transports.hierarchical().hierarchy
    total = np.empty(x.size + 1, dtype=x.dtype)  # the last element: the leaders' error flag
    total[:-1] = x.reshape(-1)
    total[-1] = 0
    reduce_to_leader(h, total[:-1])
    error = ""
    if h.between_nodes:
        assert h.leaders is not None
        try:
            total[:-1] = compressed.compressed_sum(h.leaders, total[:-1], codec, False, where, h.nodes)
        except InvalidArgumentError as exc:  # raised alike on every leader
            error, total[-1] = str(exc), 1
    if h.node.Get_size() > 1:
        mpi.bcast(h.node, total, root=0)
        if total[-1]:
            error = h.node.bcast(error, root=0)  # the message, on the error path only
    if error:
        raise InvalidArgumentError(error)
    out = total[:-1]
    if mean:
        out /= self.size
    return out
