"""What a sum mode uses of the ``Collectives`` it sums over: its communicator, this rank, the
number of ranks, and its transports (the hierarchical route's communicators).

A protocol of its own, beside ``state.CollectiveState``, so that the state can name its sum mode
(``sum_modes.SumMode``) while the sum modes name what they use of it.

>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> isinstance(Collectives(MPI.COMM_SELF.Dup()), Ranks)
True
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from mpi4py import MPI

from mpistrat.comm.transport import Transports

__all__ = ["Ranks"]


@runtime_checkable
class Ranks(Protocol):
    """The ranks a sum runs over (a ``Collectives`` is one)."""

    comm: MPI.Intracomm
    rank: int
    size: int
    transports: Transports
