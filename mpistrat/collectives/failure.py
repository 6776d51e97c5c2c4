"""A collective that fails on some ranks: what its failure tells the rest of the program.

A collective opens with its handshake; once that has passed, every rank is committed to its
transfers. An error raised on one rank after that (in a transfer, or between the transfers of a
collective that makes several, as an optimizer step's update between its reduce-scatter and its
all-gather) leaves the other ranks waiting in a transfer this rank will never join. Such an
error cannot be shared: ``strategy.run``'s closing handshake would wait for ranks that are in a
transfer (and must not be paired with it). So the failure is counted (``Collectives.failures``:
``strategy.run`` then raises the error on this rank alone, and the exception hook ends the job),
and the rank counts as having completed only the collective before (its exit hook then tells the
others, stuck in the transfer, that it left before it, and they end too).

A collective decorated with ``@watchdog.collective`` counts its own failures; a caller that
moves data through several of them after one handshake calls :func:`abandon` when that part
raises.

>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> c = Collectives(MPI.COMM_SELF.Dup())
>>> try:
...     raise FloatingPointError("in an update between two transfers")
... except FloatingPointError:
...     abandon(c)
>>> c.failures
1
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpistrat.collectives.state import CollectiveState as Collectives

__all__ = ["abandon"]


def abandon(collectives: Collectives | None) -> None:
    """Collective #``collectives.seq`` raised on this rank after its handshake, between its transfers:
    count it as that collective's failure (see the module's docstring). None (no collectives): nothing.
    Called where the error is caught, to be raised again: a step pays nothing for it otherwise."""
    if collectives is not None:
        collectives.failures += 1
        monitor = collectives.monitor
        monitor.completed = min(monitor.completed, collectives.seq - 1)
