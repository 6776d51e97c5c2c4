"""Non-blocking in-place sums of one flat host buffer, for a caller whose own handshake agrees on them.

:func:`start` posts an ``Iallreduce`` (or an ``Ireduce_scatter_block``: rank ``r``'s block of
the sum lands at the start of the buffer, the rest is left undefined) and returns its request;
:func:`progress` tests the requests in flight (an MPI library without a progress thread moves a
non-blocking collective on only inside MPI calls); :func:`complete` waits for one, watched as a
collective (stall warnings, timeouts). Every rank starts the same sums, of the same sizes, in
the same order, as for blocking collectives. MPICH adds in the order of its blocking
``Allreduce`` (``Reduce_scatter_block``), so the bits are theirs; Open MPI's non-blocking
algorithms (libnbc) may add in another order from 3 ranks on, a difference of rounding.

>>> import numpy as np
>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> c = Collectives(MPI.COMM_SELF.Dup())
>>> buf = np.arange(4.0)
>>> complete(c, start(c, buf, scatter=False)); buf
array([0., 1., 2., 3.])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from mpistrat.diagnostics import watchdog

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives
    from mpistrat.options import CommunicationOptions

__all__ = ["complete", "progress", "start"]


def start(self: Collectives, buf: Any, *, scatter: bool) -> MPI.Request:
    """Start summing the 1-D NumPy ``buf`` across ranks in place (``scatter``: reduce-scatter)."""
    if scatter:
        return self.comm.Ireduce_scatter_block(MPI.IN_PLACE, buf, op=MPI.SUM)
    return self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)


def progress(requests: list[MPI.Request]) -> bool:
    """Let MPI move the sums in flight on (completed ones are tested at no cost); whether all are done."""
    return bool(MPI.Request.Testall(requests))


@watchdog.collective("all_reduce")
def complete(
    self: Collectives,
    request: MPI.Request,
    *,
    kind: str = "all_reduce",
    options: CommunicationOptions | None = None,
) -> None:
    """Wait for ``request``; a timeout (``options.timeout_seconds``, else the strategy's or
    ``MPISTRAT_TIMEOUT``) raises here, as in a blocking collective."""
    if self.monitor.polled:
        watchdog.wait(self.monitor, request)
    else:
        request.Wait()
