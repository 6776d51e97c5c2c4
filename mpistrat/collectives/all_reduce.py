"""all_reduce: sum (or mean) a nest of arrays across ranks, one ``Allreduce`` per dtype pack.

>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> Collectives(MPI.COMM_SELF.Dup()).all_reduce("mean", {"a": 1, "b": [40, 1]})
{'a': np.float64(1.0), 'b': [np.float64(40.0), np.float64(1.0)]}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from mpistrat.collectives import leaves as lv
from mpistrat.collectives.fingerprint import arrays_code
from mpistrat.collectives.handshake import agree_within
from mpistrat.collectives.sum_modes import PLAIN, route_code, sum_mode
from mpistrat.comm import mpi, packing
from mpistrat.diagnostics import watchdog
from mpistrat.errors import MpistratError
from mpistrat.options import CommunicationImplementation, CommunicationOptions
from mpistrat.reduce_op import ReduceOp

if TYPE_CHECKING:
    from mpistrat.collectives.state import CollectiveState

_SUM = MPI.SUM  # passed by position: mpi4py parses a keyword on every call

__all__ = ["all_reduce", "allreduce_arrays", "describe", "reduce_special"]


@watchdog.collective("all_reduce")
def all_reduce(
    self: CollectiveState,
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
    if (
        options is None
        and error is None
        and (type(value) is np.ndarray or packing.is_device_array(value))
        and self.sum_mode is PLAIN
    ):
        plan = _array_plan(self, reduce_op, value)
        if plan is not None:
            return _all_reduce_array(self, plan, value, kind)
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
        fingerprint = arrays_code(
            self.caches.codes, op, impl, treespec, arrays, bytes_per_pack=opts.bytes_per_pack
        )
    mode = sum_mode(opts)
    agree_within(
        self,
        kind,
        fingerprint=fingerprint ^ mode.code ^ route_code(opts.implementation),
        describe=lambda: describe(value, op, _route(opts, device=impl is not None), opts),
        error=error,
        options=opts,
        deferrable=True,
    )
    if mode is not PLAIN:
        out = reduce_special(self, arrays, op is ReduceOp.MEAN, opts, kind)
    else:
        divisor = self.size if op is ReduceOp.MEAN else None
        out = allreduce_arrays(self, arrays, opts.bytes_per_pack, opts.implementation, divisor, packs)
    return lv.unflatten(treespec, out if numpy_only else lv.like_leaves(leaves, out))


def allreduce_arrays(
    self: CollectiveState,
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
    flat = implementation is not CommunicationImplementation.HIERARCHICAL
    for p in packs:
        # Host arrays go straight to MPI (it reads their type) unless summed node by node; device
        # arrays pick a transport.
        host = p.module is np and flat
        transport: Any = None if host else self.transports.get(p.module, implementation, p.dtype, "allreduce")
        if len(p.indices) == 1 and packing.is_contiguous(arrays[p.indices[0]]):
            i = p.indices[0]
            recv = packing.empty(arrays[i].shape, p.dtype, p.module, self.caches.buffers)
            if host:
                if mpi.COUNT_LIMIT is None or recv.size <= mpi.COUNT_LIMIT:
                    self.comm.Allreduce(arrays[i], recv, _SUM)
                else:
                    mpi.allreduce(self.comm, arrays[i], recv)
            else:
                if p.module is not np:
                    mpi.check_count(recv.size, "all_reduce")
                transport.allreduce(arrays[i], recv)
            out[i] = recv if divisor is None else lv.divide(recv, divisor)
        else:
            buf = packing.pack(arrays, p, self.caches.buffers)
            if host:
                mpi.allreduce(self.comm, MPI.IN_PLACE, buf)
            else:
                if p.module is not np:
                    mpi.check_count(buf.size, "all_reduce")
                transport.allreduce(buf, buf)
            packing.unpack(buf if divisor is None else lv.divide(buf, divisor), arrays, p, out)
    return out


def reduce_special(
    self: CollectiveState, arrays: list[Any], mean: bool, opts: CommunicationOptions, kind: str
) -> list[Any]:
    """Sum (MEAN: average) with ``opts.reduction`` set: per pack, the mode's sum for the packs it
    takes (exact, or 16-bit values on the wire); the other packs go the plain way."""
    mode = sum_mode(opts)
    out: list[Any] = [None] * len(arrays)
    for p in packing.plan_packs(arrays, opts.bytes_per_pack):
        if not mode.takes(p.dtype):
            part = allreduce_arrays(
                self,
                [arrays[i] for i in p.indices],
                0,
                opts.implementation,
                self.size if mean else None,
            )
            for i, o in zip(p.indices, part, strict=True):
                out[i] = o
            continue
        buf = packing.pack(arrays, p)
        result = mode.sum(self, buf, kind=kind, mean=mean, implementation=opts.implementation)
        packing.unpack(result, arrays, p, out)
    return out


def describe(value: Any, op: ReduceOp | None, impl: str | None, opts: CommunicationOptions) -> dict[str, Any]:
    """``mismatch.describe``, with the reduction settings as a last entry when they are not plain:
    a rank that differs only in them is named with them (the other: "no such leaf")."""
    from mpistrat.collectives import mismatch  # the ranks disagree: not every job's path

    described = mismatch.describe(value, op, implementation=impl, bytes_per_pack=opts.bytes_per_pack)
    if not opts.reduction:  # as the plain paths describe themselves
        return described
    settings = f"deterministic={bool(opts.deterministic)} compression={opts.compression or 'none'}"
    described["leaves"].append(("CommunicationOptions", settings, None))  # after the leaves: named last
    described["advice"] = (
        "Every rank must pass the same nest structure, dtypes and shapes. Every rank must also pass the "
        "same CommunicationOptions deterministic and compression settings."
    )
    return described


def _array_plan(self: CollectiveState, reduce_op: Any, x: Any) -> tuple[Any, ...] | None:
    """What ``all_reduce`` of one plain NumPy or CuPy array needs to know beyond the array: its
    ReduceOp, fingerprint and pack plan, and whether it goes straight to MPI; None where the
    one-array path does not take it (a reduce_op not seen yet, a dtype not plain, a device array
    summed node by node). Remembered per shape: a hit is the same reduce_op, dtype and array type,
    so a loop's calls skip their checks. The fingerprint is the one the nest path computes."""
    known = self.caches.arrays.get(x.shape)
    if known is not None and known[0] is reduce_op and known[1] is x.dtype and known[2] is type(x):
        return known[3]
    op = lv.known_reduce_op(reduce_op)
    if op is None or not lv.plain(x.dtype):
        return None
    opts = self.options
    hierarchical_route = opts.implementation is CommunicationImplementation.HIERARCHICAL
    if type(x) is np.ndarray:
        fingerprint, packs = lv.numpy_plan(self.caches, op, lv.LEAF_SPEC, [x], opts.bytes_per_pack)
        fingerprint ^= route_code(opts.implementation)
    elif hierarchical_route:
        return None
    else:
        implementation = lv.device_implementation([x], opts)
        fingerprint = arrays_code(
            self.caches.codes, op, implementation, lv.LEAF_SPEC, [x], bytes_per_pack=opts.bytes_per_pack
        )
        packs = packing.plan_packs([x], opts.bytes_per_pack, None, self.caches.packs)
    # A small host array summed flat: allreduce_arrays' one-leaf branch, without its pack loop.
    direct = type(x) is np.ndarray and x.nbytes < packing.POOL_MIN_BYTES and not hierarchical_route
    plan = (op, fingerprint, packs, direct)
    self.caches.arrays.keep(x.shape, (reduce_op, x.dtype, type(x), plan))
    return plan


def _all_reduce_array(self: CollectiveState, plan: tuple[Any, ...], x: Any, kind: str) -> Any:
    """``all_reduce`` of one plain NumPy or CuPy array (``plan``: :func:`_array_plan`'s), without
    the nest bookkeeping."""
    op, fingerprint, packs, direct = plan
    if not self.check:
        self.seq += 1  # agree_within with the check off, inline: this is every call's path
    elif (step := self.step_check) is not None and step.defer(self.seq + 1, kind, fingerprint):
        self.seq += 1  # MPISTRAT_CHECK=step, once learned: numbered, recorded, nothing sent
    else:
        agree_within(
            self,
            kind,
            fingerprint=fingerprint,
            describe=lambda: describe(x, op, _route(self.options, type(x) is not np.ndarray), self.options),
            deferrable=True,
        )
    divisor = self.size if op is ReduceOp.MEAN else None
    if direct and (mpi.COUNT_LIMIT is None or x.size <= mpi.COUNT_LIMIT):  # the limit: a test may set it
        flags = x.flags
        if flags.c_contiguous and flags.aligned:
            recv = np.empty(x.shape, x.dtype)
            self.comm.Allreduce(x, recv, _SUM)
            return recv if divisor is None else lv.divide(recv, divisor)
    return allreduce_arrays(self, [x], 0, self.options.implementation, divisor, packs)[0]


def _route(opts: CommunicationOptions, device: bool) -> str | None:
    """What a mismatch names beside the leaves: the implementation where device arrays are summed,
    else the host sums' route where it is not flat MPI; the same on both paths of one call."""
    if device:
        return opts.implementation.value
    return "HIERARCHICAL" if opts.implementation is CommunicationImplementation.HIERARCHICAL else None
