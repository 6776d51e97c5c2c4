"""reduce_along_axis: sum (or mean) every rank's arrays along an axis and across ranks.

What a cross-replica ``reduce(op, value, axis)`` needs when every rank executes: each
leaf is summed along ``axis`` on its rank, the sums are all-reduced, and MEAN divides by
the number of elements along ``axis`` over all ranks (uneven batches give the exact
mean). Sizes along ``axis`` may differ between ranks.

With ``CommunicationOptions(deterministic=True)`` the floating-point leaves never go
through a rounded local sum: every element along ``axis`` on every rank is one
contribution to the exact sum (:mod:`.exact_sum`), rounded once. A global batch split
over 1, 2, 3 or 4 ranks then gives the same bits.

>>> import numpy as np
>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> from mpistrat.options import CommunicationOptions
>>> c = Collectives(MPI.COMM_SELF.Dup())
>>> x = np.array([1e8, 1.0, -1e8, 1.0], np.float32)
>>> exact = CommunicationOptions(deterministic=True)
>>> c.reduce_along_axis("sum", x, 0), c.reduce_along_axis("sum", x, 0, exact)
(np.float32(1.0), np.float32(2.0))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat.collectives import exact_sum
from mpistrat.collectives import leaves as lv
from mpistrat.collectives.all_reduce import describe
from mpistrat.collectives.fingerprint import code_of
from mpistrat.collectives.sum_modes import EXACT
from mpistrat.comm import packing
from mpistrat.diagnostics import watchdog
from mpistrat.errors import InvalidArgumentError, MpistratError
from mpistrat.options import CommunicationOptions
from mpistrat.reduce_op import ReduceOp

if TYPE_CHECKING:
    from mpistrat.collectives.state import CollectiveState

__all__ = ["mean_of", "reduce_along_axis"]


@watchdog.collective("reduce")
def reduce_along_axis(
    self: CollectiveState,
    reduce_op: ReduceOp | str,
    value: Any,
    axis: int,
    options: CommunicationOptions | None = None,
    *,
    kind: str = "reduce",
    error: MpistratError | None = None,
) -> Any:
    """Reduce each leaf along ``axis`` and across ranks; MEAN divides by the global count along it.

    SUM keeps each leaf's dtype; MEAN keeps a float dtype (integers give float64).
    """
    opts, op, arrays = self.options, ReduceOp.SUM, []
    leaves: list[Any] = []
    treespec: Any = None
    try:
        opts = self.options.merge(options)
        op = lv.reduce_op(reduce_op)
        if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
            raise InvalidArgumentError(f"{kind}: axis must be an int; got {axis!r}")
        leaves, treespec = lv.flatten(value, self.caches.flat)
        arrays = lv.to_arrays(value, leaves, kind)
        for i, a in enumerate(arrays):
            if not -a.ndim <= axis < a.ndim:
                raise InvalidArgumentError(
                    f"{kind}: leaf {lv.leaf_path(value, i)}: axis {axis} is out of range for shape {a.shape}"
                )
    except MpistratError as exc:
        error, arrays = error or exc, []
    if opts.deterministic is not True:
        sums = [a.sum(axis=axis, dtype=a.dtype) for a in arrays]
        counts = [a.shape[axis] for a in arrays]
        total_sums, total_counts = self.all_reduce(
            ReduceOp.SUM, (sums, counts), options, kind=kind, error=error
        )
        if op is ReduceOp.MEAN:
            total_sums = [mean_of(s, c) for s, c in zip(total_sums, total_counts, strict=True)]
        return lv.unflatten(treespec, total_sums)
    moved = [lv.moveaxis_to_front(a, int(axis) % a.ndim) for a in arrays]
    rest = [(packing.dtype_name(a), a.shape[1:]) for a in moved]
    fingerprint = code_of(op, "axis", treespec, *rest, memo=self.caches.codes)
    self.agree(
        kind,
        fingerprint=fingerprint ^ EXACT.code,
        describe=lambda: describe(value, op, None, opts) | {"axis": axis},
        error=error,
        options=opts,
        deferrable=True,
    )
    exact = [i for i, a in enumerate(moved) if exact_sum.supported(a.dtype)]
    others = [i for i in range(len(moved)) if i not in set(exact)]
    out: list[Any] = [None] * len(moved)
    if others:  # integers are exact already: summed locally, then one plain all_reduce
        sums = [moved[i].sum(axis=0, dtype=moved[i].dtype) for i in others]
        counts = [moved[i].shape[0] for i in others]
        plain = CommunicationOptions(deterministic=False)
        total_sums, total_counts = self.all_reduce(ReduceOp.SUM, (sums, counts), plain, kind=kind)
        for i, s, c in zip(others, total_sums, total_counts, strict=True):
            out[i] = mean_of(s, c) if op is ReduceOp.MEAN else s
    for dtype in dict.fromkeys(moved[i].dtype for i in exact):  # one pack per dtype, in first-seen order
        _exact_pack(self, [i for i in exact if moved[i].dtype == dtype], moved, op, out)
    return lv.unflatten(treespec, out)


def mean_of(total: Any, count: Any) -> Any:
    """``total / count`` in ``total``'s float dtype (tf keeps float32 and float16); integers give float64."""
    xp = packing.array_module(total)
    total = xp.asarray(total)
    if total.dtype.kind in "fc":
        return total / xp.asarray(count, dtype=total.dtype)
    return xp.true_divide(total, count)


def _exact_pack(
    self: CollectiveState, members: list[int], moved: list[Any], op: ReduceOp, out: list[Any]
) -> None:
    """The leaves ``members`` (one dtype) as one ``[rows, elements]`` block of contributions,
    shorter leaves padded with zero rows (zeros add nothing); their counts ride along."""
    hosts = [m if packing.array_module(m) is np else m.get() for m in (moved[i] for i in members)]
    dtype = hosts[0].dtype
    real = dtype if dtype.kind == "f" else np.dtype(hosts[0].real.dtype)
    elements = [int(np.prod(h.shape[1:], dtype=np.int64)) for h in hosts]
    widths = [n * (2 if dtype.kind == "c" else 1) for n in elements]
    rows = max(h.shape[0] for h in hosts)
    block = np.zeros((rows, sum(widths)), dtype=real)
    at = 0
    for h, n, w in zip(hosts, elements, widths, strict=True):
        block[: h.shape[0], at : at + w] = np.ascontiguousarray(h).reshape(h.shape[0], n).view(real)
        at += w
    counts = [h.shape[0] for h in hosts]

    def divisors(totals: list[int]) -> Any:
        return np.repeat(np.asarray(totals, dtype=np.int64), widths) if op is ReduceOp.MEAN else None

    summed, _ = exact_sum.exact_sum(self.comm, block, counts, divisors)
    at = 0
    for i, h, w in zip(members, hosts, widths, strict=True):
        result = summed[at : at + w].copy().view(dtype).reshape(h.shape[1:])
        at += w
        module = packing.array_module(moved[i])
        out[i] = (result[()] if result.ndim == 0 else result) if module is np else module.asarray(result)
