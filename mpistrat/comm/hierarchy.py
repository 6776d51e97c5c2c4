"""Node-aware sums: within each node, then between one leader per node, then within the node again.

``CommunicationImplementation.HIERARCHICAL`` carries host (NumPy) all-reduces this way:

1. ``Reduce`` to the node's leader (node-local rank 0) over the node's communicator
   (``COMM_TYPE_SHARED``: shared memory);
2. ``Allreduce`` of the node sums between the leaders, one per node (the network);
3. ``Bcast`` of the total from each leader to its node.

Only leaders send between nodes, each what a ring all-reduce over the N nodes sends
(2n(N-1)/N for n bytes), however many ranks share a node: where the links between nodes, not
shared memory, are the bottleneck, that is the point. The sub-communicators are made at the
first use (collective over the strategy's communicator, which every rank reaches together after
the collective's handshake) and freed with the strategy.

>>> import numpy as np
>>> from mpi4py import MPI
>>> x = np.arange(4.0)
>>> HierarchicalMPI(MPI.COMM_SELF.Dup()).allreduce(x, x); x
array([0., 1., 2., 3.])
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
from mpi4py import MPI

from mpistrat.comm import mpi
from mpistrat.comm.base import Transport

__all__ = ["LEADERS", "NODE", "Hierarchy", "HierarchicalMPI"]

NODE, LEADERS = "mpistrat node", "mpistrat leaders"  # the sub-communicators' names (MPI_Comm_set_name)


class Hierarchy:
    """One communicator's ranks split by node: ``node`` (this node's ranks) and, on each node's
    leader, ``leaders`` (one rank per node; ``None`` on the other ranks) and ``nodes`` (for each
    leader, in the leaders' order, the ranks of ``comm`` on its node: what an error found between
    the leaders names). Collective to make."""

    def __init__(self, comm: MPI.Intracomm):
        rank = comm.Get_rank()
        # Splits of an intracommunicator are intracommunicators (mpi4py's stubs say Comm).
        self.node = cast(MPI.Intracomm, comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank))
        self.node.Set_name(NODE)
        self.leader = self.node.Get_rank() == 0
        leaders = comm.Split(0 if self.leader else MPI.UNDEFINED, key=rank)
        self.leaders = cast(MPI.Intracomm, leaders) if self.leader else None
        self.nodes: list[list[int]] = []
        if self.leaders is not None:
            self.leaders.Set_name(LEADERS)
            mine = MPI.Group.Translate_ranks(
                self.node.Get_group(), range(self.node.Get_size()), comm.Get_group()
            )
            self.nodes = self.leaders.allgather(sorted(mine))

    @property
    def between_nodes(self) -> bool:
        """Whether this rank takes part in the leg between nodes (a leader, with other nodes)."""
        return self.leaders is not None and self.leaders.Get_size() > 1

    def free(self) -> None:
        for comm in (self.node, self.leaders):
            if comm is not None and comm != MPI.COMM_NULL:
                comm.Free()


class HierarchicalMPI(Transport):
    """Host buffers summed within the node, between the nodes' leaders, then broadcast in the node."""

    name = "hierarchical mpi"

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm
        self._hierarchy: Hierarchy | None = None

    @property
    def made(self) -> Hierarchy | None:
        """The node and leader communicators, if made yet (no communication)."""
        return self._hierarchy

    @property
    def hierarchy(self) -> Hierarchy:
        """The node and leader communicators (made on first use: collective)."""
        if self._hierarchy is None:
            self._hierarchy = Hierarchy(self.comm)
        return self._hierarchy

    def allreduce(self, send: Any, recv: Any) -> None:
        """``recv`` = the sum over every rank of ``send`` (``recv`` itself: in place); 1-D contiguous."""
        h = self.hierarchy
        if send is not recv:
            np.copyto(recv, send)
        flat = recv.reshape(-1)
        reduce_to_leader(h, flat)
        if h.between_nodes:
            assert h.leaders is not None
            mpi.allreduce(h.leaders, MPI.IN_PLACE, flat)
        if h.node.Get_size() > 1:
            mpi.bcast(h.node, flat, root=0)

    def bcast(self, buf: Any, root: int) -> None:
        mpi.bcast(self.comm, buf, root=root)

    def close(self) -> None:
        if self._hierarchy is not None:
            self._hierarchy.free()
            self._hierarchy = None


def reduce_to_leader(h: Hierarchy, flat: np.ndarray) -> None:
    """Sum the node's ``flat`` into its leader's ``flat``, in pieces of at most the count limit
    (the other ranks' ``flat`` is left as it was)."""
    if h.node.Get_size() == 1:
        return
    for a, b in mpi.pieces(flat.size):
        part = flat[a:b]
        h.node.Reduce(MPI.IN_PLACE if h.leader else part, part, op=MPI.SUM, root=0)
