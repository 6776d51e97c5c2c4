"""Exact sums of floating-point contributions: ``CommunicationOptions(deterministic=True)``.

Floating-point addition is not associative, so an ``MPI_Allreduce`` answer depends on the
algorithm, the message size and the rank order. Integer addition is associative. Each pack
of floats is therefore summed as fixed-point integers:

1. Every rank finds, per element, the largest and smallest exponent among its nonzero
   contributions (and whether any is infinite or NaN); one ``Allreduce(MAX)`` of these
   codes (one byte each for float16/float32, two for float64) makes them global.
2. From them every rank computes the same fixed-point frame per element: ``l`` limbs of
   ``B`` bits, ``B = 2 * floor((63 - ceil(log2 R)) / 2)``, wide enough to hold every
   contribution exactly, with headroom for the local contributions' count.
3. Each rank converts its contributions (several per element along a reduced axis) to
   integer digits, sums them exactly in int64 and carries, and one ``Allreduce(SUM)`` of the
   int64 limbs adds the ranks' integers (exact: no limb can overflow, see docs/concepts.md).
4. The integer is carried again and rounded once, to nearest even, into the dtype.

The result is the exact sum rounded once (MEAN: the exact quotient rounded once), so it has
the same bits for any rank count, rank order, pack size and MPI algorithm. Elements with an
infinite or NaN contribution get the IEEE answer (inf, -inf or NaN) from one more
``Allreduce`` of those contributions alone, whose answer does not depend on the order.

>>> import numpy as np
>>> from mpi4py import MPI
>>> x = np.array([[1e8, 1.0, -1e8, 2.0**-30]], dtype=np.float32).T   # 4 contributions, 1 element
>>> exact_sum(MPI.COMM_SELF, x, [])[0]
array([1.], dtype=float32)
>>> float(np.cumsum(x)[-1])  # the same contributions added in order, in float32
9.313225746154785e-10
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
from mpi4py import MPI

from mpistrat.comm import mpi

__all__ = ["Format", "digit_bits", "exact_sum", "format_of", "supported"]


@dataclasses.dataclass(frozen=True)
class Format:
    """An IEEE binary format: ``p`` significand bits (the hidden one included), ``ebits`` exponent bits."""

    dtype: np.dtype
    uint: type
    p: int
    ebits: int

    @property
    def fracbits(self) -> int:
        return self.p - 1

    @property
    def emax(self) -> int:
        """The biased exponent of infinities and NaNs."""
        return (1 << self.ebits) - 1

    @property
    def bias(self) -> int:
        return (1 << (self.ebits - 1)) - 1

    @property
    def code(self) -> type:
        """The dtype of the exponent codes that the MAX reduction carries."""
        return np.uint8 if self.emax <= 255 else np.uint16

    @property
    def emin_unit(self) -> int:
        """The exponent of the smallest subnormal's unit."""
        return 1 - self.bias - self.fracbits


_FORMATS = {
    np.dtype(np.float16): Format(np.dtype(np.float16), np.uint16, 11, 5),
    np.dtype(np.float32): Format(np.dtype(np.float32), np.uint32, 24, 8),
    np.dtype(np.float64): Format(np.dtype(np.float64), np.uint64, 53, 11),
}


def format_of(dtype: np.dtype) -> Format | None:
    """The format of a real float dtype, or of a complex dtype's parts; None if not supported."""
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        dtype = np.dtype(dtype.char.lower()) if dtype.char in "FD" else np.dtype(f"f{dtype.itemsize // 2}")
    return _FORMATS.get(dtype)


def supported(dtype: np.dtype) -> bool:
    """Whether deterministic sums take this dtype's exact path (float16/32/64 and complex of them)."""
    return np.dtype(dtype).kind in "fc" and format_of(dtype) is not None


@functools.cache
def digit_bits(size: int) -> int:
    """``H``: half the bits of a limb. Limbs hold ``B = 2H`` bits, and ``size`` ranks' limbs, each
    below ``2**B`` in magnitude, add up below ``2**63``: ``B <= 63 - ceil(log2 size)``.

    >>> digit_bits(1), digit_bits(2), digit_bits(4), digit_bits(1024)
    (31, 31, 30, 26)
    """
    return (63 - (max(size, 1) - 1).bit_length()) // 2


# Rows of contributions converted per pass; each digit's sum of a pass stays below 2**63.
_ROWS = 1 << 24


def _carry(c: np.ndarray, h: int) -> None:
    """Normalize digits in place: each below the top in ``[0, 2**h)``, the top one signed."""
    mask = (1 << h) - 1
    for d in range(c.shape[1] - 1):
        carry = c[:, d] >> h  # arithmetic shift: floor division, right for negative digits
        c[:, d] &= mask
        c[:, d + 1] += carry


@dataclasses.dataclass
class _Plan:
    """What every rank derives alike from the agreed exponent codes of one pack."""

    limbs: np.ndarray  # per element: its number of limbs (0: all zero, or not finite)
    low: np.ndarray  # per element: biased exponent of the unit of digit 0
    groups: list[tuple[int, np.ndarray]]  # (limbs, element indices), by limbs
    nonfinite: np.ndarray  # indices of elements with an infinite or NaN contribution
    size: int  # int64 limbs in all


def _parts(x: np.ndarray, fmt: Format) -> tuple[np.ndarray, ...]:
    bits: Any = x.view(fmt.uint)
    be = ((bits >> fmt.fracbits) & fmt.emax).astype(np.int64)
    frac = (bits & ((1 << fmt.fracbits) - 1)).astype(np.uint64)
    negative = (bits >> (8 * fmt.dtype.itemsize - 1)) != 0
    nonfinite = be == fmt.emax
    active = ~nonfinite & ((be != 0) | (frac != 0))
    m = np.where(be > 0, frac | np.uint64(1 << fmt.fracbits), frac)
    return np.maximum(be, 1), m, negative, active, nonfinite


def _codes(eu: np.ndarray, active: np.ndarray, nonfinite: np.ndarray, rows: int, fmt: Format) -> np.ndarray:
    """Per element the largest exponent code, ``emax`` minus the smallest, then ``ceil(log2 rows)``."""
    top = np.where(active, eu, np.where(nonfinite, fmt.emax, 0)).max(axis=0, initial=0)
    bottom = np.where(active, fmt.emax - eu, 0).max(axis=0, initial=0)
    return np.concatenate([top, bottom, [(max(rows, 1) - 1).bit_length()]]).astype(fmt.code)


def _plan(codes: np.ndarray, n: int, fmt: Format, h: int) -> _Plan:
    top = codes[:n].astype(np.int64)
    smallest = fmt.emax - codes[n : 2 * n].astype(np.int64)
    headroom = int(codes[2 * n])
    finite = (top > 0) & (top < fmt.emax)
    bits = top - smallest + fmt.p + headroom + 1  # the window: every contribution, count and sign
    limbs = np.where(finite, -(-bits // (2 * h)), 0)
    low = top + fmt.p + headroom + 1 - limbs * 2 * h
    groups = [(int(ell), np.flatnonzero(limbs == ell)) for ell in np.unique(limbs) if ell > 0]
    return _Plan(limbs, low, groups, np.flatnonzero(top == fmt.emax), int(limbs.sum()))


def _to_limbs(
    eu: np.ndarray, m: np.ndarray, negative: np.ndarray, active: np.ndarray, plan: _Plan, fmt: Format, h: int
) -> np.ndarray:
    """This rank's contributions as int64 limbs, one group after another (the wire buffer)."""
    mask = (1 << h) - 1
    pieces = -(-(fmt.p + h - 1) // h)  # digits one contribution's significand can touch
    out = []
    for ell, idx in plan.groups:
        digits = np.zeros((idx.size, 2 * ell), dtype=np.int64)
        for r0 in range(0, max(eu.shape[0], 1), _ROWS):
            rows = slice(r0, r0 + _ROWS)
            on = active[rows][:, idx]
            shift = np.where(on, eu[rows][:, idx] - plan.low[idx], 0)
            mant = np.where(on, m[rows][:, idx], np.uint64(0))
            neg = negative[rows][:, idx]
            first, offset = shift // h, (shift % h).astype(np.uint64)
            for j in range(pieces):
                if j == 0:
                    piece = (mant << offset) & np.uint64(mask)
                else:
                    piece = (mant >> (np.uint64(j * h) - offset)) & np.uint64(mask)
                signed = piece.astype(np.int64)
                signed = np.where(neg, -signed, signed)
                where = first + j
                for d in range(2 * ell):
                    digits[:, d] += np.where(where == d, signed, 0).sum(axis=0)
            _carry(digits, h)
        out.append((digits[:, 0::2] + digits[:, 1::2] * (1 << h)).reshape(-1))
    return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


def _round(wire: np.ndarray, ell: int, low: np.ndarray, fmt: Format, h: int, divisor: Any) -> np.ndarray:
    """The summed limbs of one group (``k`` elements of ``ell`` limbs) as floats, rounded once."""
    k = low.size
    mask = (1 << h) - 1
    n: Any = None
    limbs = wire.reshape(k, ell)
    c = np.zeros((k, 2 * ell + 1), dtype=np.int64)
    c[:, 0 : 2 * ell : 2] = limbs & mask
    c[:, 1 : 2 * ell : 2] = limbs >> h
    _carry(c, h)
    negative = c[:, -1] < 0
    if negative.any():
        c[negative] = -c[negative]
        sub = c[negative]
        _carry(sub, h)
        c[negative] = sub
    low = low - fmt.bias - fmt.fracbits  # the power of two of digit 0's unit
    if divisor is not None:  # the exact quotient, with a sticky bit below (see docs/concepts.md)
        extra = -(-(fmt.p + 34) // h)
        c = np.concatenate([np.zeros((k, extra), dtype=np.int64), c], axis=1)
        low = low - extra * h
        n = np.broadcast_to(np.asarray(divisor, dtype=np.int64), (k,))
        safe = np.maximum(n, 1)
        rem = np.zeros(k, dtype=np.int64)
        for d in range(c.shape[1] - 1, -1, -1):
            cur = rem * (1 << h) + c[:, d]
            c[:, d] = cur // safe
            rem = cur - c[:, d] * safe
        c[:, 0] |= rem != 0
    digits = c.shape[1]
    nonzero = c != 0
    anything = nonzero.any(axis=1)
    rows = np.arange(k)
    top = digits - 1 - np.argmax(nonzero[:, ::-1], axis=1)
    length = top * h + np.frexp(c[rows, top].astype(np.float64))[1]  # bits of the integer
    unit = np.maximum(length - 1 + low - (fmt.p - 1), fmt.emin_unit)  # the result's unit
    r = unit - low  # its bit in the integer; <= 0: the integer fits, exactly
    exact = r <= 0
    a = np.maximum(r - 1, 0)  # the round bit
    first, offset = a // h, (a % h).astype(np.uint64)
    width = -(-(fmt.p + h) // h)  # digits the p + 1 bits from the round bit up can touch
    padded = np.concatenate([c, np.zeros((k, width), dtype=np.int64)], axis=1).astype(np.uint64)
    field = padded[rows, first] >> offset
    for j in range(1, width):
        field |= padded[rows, first + j] << (np.uint64(j * h) - offset)
    field &= np.uint64((1 << (fmt.p + 1)) - 1)
    kept = np.where(exact, field, field >> np.uint64(1))
    round_bit = np.where(exact, np.uint64(0), field & np.uint64(1))
    before = np.cumsum(nonzero, axis=1)
    sticky = (padded[rows, first] & ((np.uint64(1) << offset) - np.uint64(1))) != 0
    sticky |= np.where(first > 0, before[rows, np.maximum(first - 1, 0)] > 0, False)
    up = (round_bit == 1) & (sticky | ((kept & np.uint64(1)) == 1)) & ~exact
    kept = kept + up.astype(np.uint64)
    with np.errstate(over="ignore"):
        value = np.ldexp(kept.astype(np.float64), np.where(exact, low, unit))
        value = np.where(anything, value, 0.0)
        if divisor is not None:
            value = np.where(n == 0, np.nan, value)
        value = np.where(negative, -value, value)
        return value.astype(fmt.dtype)


def _round_one_limb(ints: np.ndarray, low: np.ndarray, fmt: Format, h: int) -> np.ndarray:
    """Sums of one limb each: an integer of at most 53 significant bits converts to float64
    exactly, and scaling by a power of two keeps it exact, so the one rounding is the cast to
    the dtype. Wider integers take the general path (:func:`_round`)."""
    with np.errstate(over="ignore", invalid="ignore"):
        wide = ints.astype(np.float64)
        exact = wide.astype(np.int64) == ints  # 2**63 (rounded up) casts to INT64_MIN: not equal
        out = np.empty(ints.size, dtype=fmt.dtype)
        out[exact] = np.ldexp(wide[exact], low[exact] - fmt.bias - fmt.fracbits).astype(fmt.dtype)
    rest = ~exact
    if rest.any():
        out[rest] = _round(ints[rest], 1, low[rest], fmt, h, None)
    return out


def exact_sum(
    comm: MPI.Intracomm,
    contributions: np.ndarray,
    counts: list[int],
    divisor: Any = None,
) -> tuple[np.ndarray, list[int]]:
    """Sum ``contributions`` (``[rows, n]``, a real float dtype) over rows and ranks, exactly.

    ``counts``: int64 numbers summed alongside, in the same call (the counts of a reduced
    axis); ``divisor``: None for the sum, an int (or one per element) for the mean, or
    ``"counts"`` to divide element ``i`` by ``counts[...]`` as ``divisor_of(totals)`` —
    see :func:`mpistrat.collectives.reduce_axis`. Returns ``(n values, summed counts)``.
    Collective over ``comm``: two ``Allreduce`` calls, three when an element is not finite.
    """
    fmt = format_of(contributions.dtype)
    assert fmt is not None and contributions.dtype.kind == "f"
    x = np.ascontiguousarray(contributions)
    rows, n = x.shape
    h = digit_bits(comm.Get_size())
    eu, m, negative, active, nonfinite = _parts(x, fmt)
    codes = _codes(eu, active, nonfinite, rows, fmt)
    mpi.allreduce(comm, MPI.IN_PLACE, codes, MPI.MAX)
    plan = _plan(codes, n, fmt, h)
    wire = _to_limbs(eu, m, negative, active, plan, fmt, h)
    if counts:
        wire = np.concatenate([wire, np.asarray(counts, dtype=np.int64)])
    if wire.size:
        mpi.allreduce(comm, MPI.IN_PLACE, wire, MPI.SUM)
    totals = wire[plan.size :].tolist()
    if callable(divisor):
        divisor = divisor(totals)
    out = np.zeros(n, dtype=fmt.dtype)
    at = 0
    for ell, idx in plan.groups:
        part = divisor if divisor is None or np.ndim(divisor) == 0 else np.asarray(divisor)[idx]
        chunk = wire[at : at + ell * idx.size]
        if ell == 1 and divisor is None:
            out[idx] = _round_one_limb(chunk, plan.low[idx], fmt, h)
        else:
            out[idx] = _round(chunk, ell, plan.low[idx], fmt, h, part)
        at += ell * idx.size
    if divisor is not None:  # elements whose every contribution is zero: 0 / count
        zero = plan.limbs == 0
        if np.ndim(divisor):
            out[zero & (np.asarray(divisor) == 0)] = np.nan
        elif divisor == 0:
            out[zero] = np.nan
    if plan.nonfinite.size:  # inf and NaN: the IEEE sum of those contributions alone, in any order
        idx = plan.nonfinite
        sub = x[:, idx]
        with np.errstate(invalid="ignore"):  # inf + -inf is NaN, as it should be
            special = np.where(np.isfinite(sub), 0, sub).sum(axis=0, dtype=fmt.dtype)
            mpi.allreduce(comm, MPI.IN_PLACE, special, MPI.SUM)
        out[idx] = np.where(np.isnan(special), np.nan, special)  # one NaN, whatever the payloads
    return out, totals
