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

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from mpistrat.collectives import exact_sum
from mpistrat.collectives.sum_modes import PLAIN, sum_mode
from mpistrat.comm import mpi, packing
from mpistrat.diagnostics import watchdog
from mpistrat.errors import InvalidArgumentError
from mpistrat.options import CommunicationImplementation, CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.collectives.state import CollectiveState

__all__ = [
    "all_gather_bytes",
    "all_gather_in_place",
    "all_reduce_in_place",
    "all_to_all_bytes",
    "exact_mean_in_place",
    "exchange",
    "reduce_scatter_in_place",
]


@watchdog.collective("all_reduce")
def all_reduce_in_place(
    self: CollectiveState,
    buf: Any,
    *,
    kind: str = "all_reduce",
    options: CommunicationOptions | None = None,
    maximum: bool = False,
) -> None:
    """Sum ``buf`` across ranks into itself (host buffers to MPI, device buffers to their transport).

    ``options``: the call's (the default: the collectives' own); their ``deterministic`` or
    ``compression`` make the sum exact or carry 16-bit values (floating-point buffers).
    ``maximum``: the largest value instead of the sum (a host buffer, as MPI takes it).
    """
    if maximum:
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
        return
    opts = self.options if options is None else self.options.merge(options)
    implementation = opts.implementation
    mode = self.sum_mode if options is None else sum_mode(opts)
    if mode.takes(buf.dtype):
        total = mode.sum(self, buf.reshape(-1), kind=kind, implementation=implementation)
        buf[...] = total.reshape(buf.shape)
        return
    if type(buf) is np.ndarray and implementation is not CommunicationImplementation.HIERARCHICAL:
        if mpi.COUNT_LIMIT is None:
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        else:
            mpi.allreduce(self.comm, MPI.IN_PLACE, buf)
        return
    module = packing.array_module(buf)
    if module is not np:
        mpi.check_count(buf.size, kind)
    transport = self.transports.get(module, implementation, buf.dtype, "allreduce")
    transport.allreduce(buf, buf)


@watchdog.collective("reduce_scatter")
def reduce_scatter_in_place(
    self: CollectiveState,
    buf: Any,
    *,
    kind: str = "reduce_scatter",
    options: CommunicationOptions | None = None,
) -> None:
    """Sum ``buf`` (``size`` equal blocks) across ranks; rank ``r``'s block of the sum lands at the
    start of its ``buf`` (the rest is left undefined).

    Compressed: one ``Alltoall`` of 16-bit values, each rank summing its block in float32.
    Deterministic: the exact all-reduce of the whole buffer, this rank's block kept (twice the
    bytes of a reduce-scatter). Blocks beyond the count limit: an all-reduce in pieces, likewise.
    Device buffers: their transport's reduce-scatter (NCCL, CUDA-aware MPI, or host staging);
    exact or compressed, the mode's all-reduce through the host, this rank's block kept.
    """
    opts = self.options if options is None else self.options.merge(options)
    mode = self.sum_mode if options is None else sum_mode(opts)
    module = packing.array_module(buf)
    if module is np:
        (mode if mode.takes(buf.dtype) else PLAIN).reduce_scatter(self, buf, kind)
        return
    _contiguous(buf, kind)
    if mode.takes(buf.dtype):  # exact or compressed: their all-reduce (through the host), this block kept
        per = buf.size // self.size
        total = mode.sum(self, buf.reshape(-1), kind=kind, implementation=opts.implementation)
        buf[:per] = total[self.rank * per : (self.rank + 1) * per]
        return
    mpi.check_count(buf.size, kind)
    self.transports.get(module, opts.implementation, buf.dtype, "reduce_scatter").reduce_scatter(buf)


@watchdog.collective("all_reduce")
def exact_mean_in_place(self: CollectiveState, rows: Any, out: Any, *, kind: str = "all_reduce") -> None:
    """``out`` (``n`` elements) becomes the sum over every rank's ``[K, n]`` ``rows`` divided by K,
    exactly and rounded once (``deterministic=True`` with gradient accumulation): the same bits
    however the rows are spread over the ranks. Two ``Allreduce`` calls, as one exact sum; device
    buffers through the host."""
    if type(rows) is not np.ndarray:
        mean = np.empty(out.shape, out.dtype)
        exact_mean_in_place(self, rows.get(), mean, kind=kind)  # a helper: part of this call
        out[...] = packing.array_module(out).asarray(mean)
        return
    rows = np.ascontiguousarray(rows)
    steps = rows.shape[0]
    if not exact_sum.supported(rows.dtype):  # no exact path for this dtype: a plain sum, then the mean
        out[...] = rows.sum(axis=0)
        mpi.allreduce(self.comm, MPI.IN_PLACE, out)
        out /= steps
        return
    real = rows.view(rows.real.dtype) if rows.dtype.kind == "c" else rows
    out[...] = exact_sum.exact_sum(self.comm, real, [], steps)[0].view(out.dtype)


@watchdog.collective("all_gather")
def all_gather_in_place(
    self: CollectiveState, buf: Any, *, kind: str = "all_gather", options: CommunicationOptions | None = None
) -> None:
    """Each rank's block ``r`` of ``buf`` (``size`` equal blocks) to every rank, in place; device
    buffers through the transport of ``options``' implementation (the default: the collectives')."""
    module = packing.array_module(buf)
    if module is not np:
        _contiguous(buf, kind)
        mpi.check_count(buf.size, kind)
        implementation = (self.options if options is None else self.options.merge(options)).implementation
        self.transports.get(module, implementation, buf.dtype, "allgather").allgather(buf)
    elif mpi.COUNT_LIMIT is None:
        self.comm.Allgather(MPI.IN_PLACE, buf)
    else:
        mpi.allgather(self.comm, MPI.IN_PLACE, buf)


@watchdog.collective("all_gather")
def all_gather_bytes(
    self: CollectiveState, mine: np.ndarray, out: np.ndarray, counts: list[int], *, kind: str = "all_gather"
) -> None:
    """Every rank's bytes ``mine`` end to end in ``out`` (host memory), ``counts[r]`` of them from
    rank ``r``: one ``Allgatherv``, or ``Allgather`` when the counts are equal (MPICH's is twice as
    fast for large messages). Uneven counts, zeros included; each below 2**31."""
    if counts.count(counts[0]) == len(counts):
        self.comm.Allgather([mine, MPI.BYTE], [out, MPI.BYTE])
        return
    displs = [0, *itertools.accumulate(counts[:-1])]
    self.comm.Allgatherv([mine, MPI.BYTE], [out, counts, displs, MPI.BYTE])


@watchdog.collective("exchange")
def exchange(
    self: CollectiveState, send: Any, dest: int, recv: Any, source: int, *, kind: str = "exchange"
) -> None:
    """``send`` to rank ``dest`` while ``recv`` fills from rank ``source``: every rank at once, the
    destinations a permutation of the ranks (a sharded optimizer's copies for its keepers). Flat
    buffers of one dtype; device buffers through the host; any count."""
    if type(send) is not np.ndarray or type(recv) is not np.ndarray:
        staged = np.empty(recv.shape, recv.dtype)
        exchange(self, packing.array_module(send).asnumpy(send), dest, staged, source, kind=kind)
        recv[...] = packing.array_module(recv).asarray(staged)
        return
    for lo, hi in mpi.pieces(max(send.size, recv.size)):
        self.comm.Sendrecv(send[lo:hi], dest, _EXCHANGE_TAG, recv[lo:hi], source, _EXCHANGE_TAG)


_EXCHANGE_TAG = 0x6D78  # beside the side channel's tag: never matched with its messages


@watchdog.collective("all_to_all")
def all_to_all_bytes(
    self: CollectiveState,
    send: np.ndarray,
    send_counts: list[int],
    recv: np.ndarray,
    recv_counts: list[int],
    *,
    kind: str = "all_to_all",
) -> None:
    """``send_counts[r]`` bytes of ``send`` (end to end, in rank order) to each rank ``r``, and
    ``recv_counts[r]`` bytes from each into ``recv``: one ``Alltoallv`` (host memory; each count
    below 2**31). A restore from node-local checkpoint copies asks and serves byte ranges with it."""
    send_at = [0, *itertools.accumulate(send_counts[:-1])]
    recv_at = [0, *itertools.accumulate(recv_counts[:-1])]
    self.comm.Alltoallv([send, send_counts, send_at, MPI.BYTE], [recv, recv_counts, recv_at, MPI.BYTE])


def _contiguous(buf: Any, kind: str) -> None:
    """Refuse a strided device buffer: a transport would move a copy of it and leave it unchanged."""
    if not buf.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{kind}: in-place transfers need a contiguous buffer; got a strided {packing.dtype_name(buf)} "
            f"array of shape {tuple(buf.shape)}"
        )
