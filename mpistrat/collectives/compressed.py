"""Sums with 16-bit values on the wire: ``CommunicationOptions(compression="bf16" | "fp16")``.

No custom MPI op and no half-precision MPI datatype: the values travel as ``uint16``.

1. Each rank rounds its float32 (or float64) pack to 16 bits once, cuts it into ``R``
   equal blocks and sends block ``r`` to rank ``r`` (one ``Alltoall``).
2. Rank ``r`` decodes the ``R`` blocks it received and sums them in float32, in rank order
   (MEAN: then divides by ``R``), and rounds its block of the sum to 16 bits (the second
   and last rounding to 16 bits).
3. One ``Allgather`` of the 16-bit blocks gives every rank the whole sum, decoded to the
   input's dtype.

Each rank sends and receives about ``2 * 2n (R-1)/R`` bytes for ``n`` values: half of what
a ring ``Allreduce`` of float32 moves, a quarter of float64's. Overflow (a finite value, or a
block's sum of finite values, beyond the codec's largest finite value: 65504 for fp16, about
3.39e38 for bf16) is an error on every rank: each rank's flag rides in its ``Allgather`` block,
so every rank sees every flag and raises the same ``InvalidArgumentError``. Infinities and NaNs
in the input are carried as such.

>>> import numpy as np
>>> from mpi4py import MPI
>>> x = np.array([1.0, 1.0 + 2**-9, 3.0e38], np.float32)
>>> compressed_sum(MPI.COMM_SELF, x, "bf16").tolist()
[1.0, 1.0, 3.00405527047391e+38]
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpistrat.comm import mpi
from mpistrat.errors import InvalidArgumentError

__all__ = [
    "BF16_MAX",
    "FP16_MAX",
    "compressed_reduce_scatter",
    "compressed_sum",
    "decode",
    "encode",
    "unit_roundoff",
]

FP16_MAX = 65504.0
BF16_MAX = 2.0**128 - 2.0**120  # (2 - 2**-7) * 2**127
_LARGEST = {"fp16": FP16_MAX, "bf16": BF16_MAX}


def unit_roundoff(codec: str) -> float:
    """The largest relative error of one rounding to ``codec`` (normal range): 2**-8 or 2**-11."""
    return 2.0**-8 if codec == "bf16" else 2.0**-11


def _to_float32_odd(x: np.ndarray) -> np.ndarray:
    """float64 to float32 rounded to odd: a later rounding to 16 bits is then correctly rounded."""
    with np.errstate(over="ignore", invalid="ignore"):
        t = x.astype(np.float32)
        back = t.astype(np.float64)
        inexact = np.isfinite(x) & (back != x)
        bits = t.view(np.uint32).copy()
        toward_zero = inexact & (np.abs(back) > np.abs(x))
        bits[toward_zero] -= np.uint32(1)
        bits[inexact] |= np.uint32(1)
    return bits.view(np.float32)


def encode(x: np.ndarray, codec: str) -> np.ndarray:
    """``x`` (float32 or float64) rounded to nearest even in ``codec``, as ``uint16`` bits.

    >>> encode(np.array([1.0, -2.5], np.float32), "bf16").tolist()
    [16256, 49184]
    """
    if x.dtype == np.float64:
        x = _to_float32_odd(x)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if codec == "fp16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint16)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(
        np.uint16
    )
    quiet = ((bits >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return np.where(np.isnan(x), quiet, rounded)


def decode(bits: np.ndarray, codec: str) -> np.ndarray:
    """16-bit ``codec`` values (``uint16``) as float32, exactly."""
    if codec == "fp16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


_EXPONENT = {"fp16": np.uint16(0x7C00), "bf16": np.uint16(0x7F80)}  # all ones: an infinity or a NaN
_MAGNITUDE = np.uint16(0x7FFF)  # all bits but the sign's


def _not_finite(encoded: np.ndarray, codec: str) -> np.ndarray:
    """Where 16-bit ``codec`` values are infinities or NaNs (from their bits: no decoding)."""
    return np.bitwise_and(encoded, _MAGNITUDE) >= _EXPONENT[codec]


def _any_not_finite(encoded: np.ndarray, codec: str) -> bool:
    """Whether any is (one pass and one reduction, no mask: the common answer is no)."""
    return encoded.size > 0 and int(np.bitwise_and(encoded, _MAGNITUDE).max()) >= _EXPONENT[codec]


def _became_infinite(values: np.ndarray, encoded: np.ndarray, codec: str) -> bool:
    """Whether a finite value's 16-bit encoding is not finite (it overflowed)."""
    if not _any_not_finite(encoded, codec):
        return False
    return bool(np.isfinite(values[_not_finite(encoded, codec)]).any())


def _blocks(comm: MPI.Intracomm, x: np.ndarray, codec: str) -> tuple[np.ndarray, bool, np.ndarray]:
    """Steps 1 and 2: this rank's block of the sum in float32 (``R`` blocks of ``ceil(n/R)``),
    whether one of this rank's values overflowed, and where the block's inputs were all finite."""
    size = comm.Get_size()
    block = -(-x.size // size)
    send = np.zeros(size * block, dtype=np.uint16)
    send[: x.size] = encode(x.reshape(-1), codec)
    overflow = _became_infinite(x.reshape(-1), send[: x.size], codec)
    recv = np.empty_like(send)
    mpi.alltoall(comm, send, recv)
    parts = decode(recv, codec).reshape(size, block)
    total = parts[0].copy()
    with np.errstate(over="ignore", invalid="ignore"):
        for r in range(1, size):  # rank order, float32: the same bits wherever MPI puts the blocks
            total += parts[r]
    return total, overflow, parts


def _sum_overflows(encoded: np.ndarray, parts: np.ndarray, codec: str) -> bool:
    """Whether a block sum of finite values is not finite once summed in float32 and rounded to 16
    bits (only where the result is not finite are the parts looked at: rarely)."""
    if not _any_not_finite(encoded, codec):
        return False
    return bool(np.isfinite(parts[:, _not_finite(encoded, codec)]).all(axis=0).any())


def _raise_overflow(flags: np.ndarray, codec: str, where: str, nodes: list[list[int]] | None = None) -> None:
    ranks = np.flatnonzero(flags).tolist()
    on = f"on rank(s) {ranks}"
    if nodes:  # the ranks were nodes' leaders, each sending its node's sum: name the strategy's ranks there
        members = sorted(r for leader in ranks for r in nodes[leader])
        on = f"on rank(s) {members} (their node's sum, between nodes)"
    advice = (
        "Use compression='bf16' (float32's range), scale the values down (a loss scale), or turn "
        "compression off"
        if codec == "fp16"
        else "Scale the values down, or turn compression off"
    )
    raise InvalidArgumentError(
        f"{where}: compression={codec!r} overflowed {on}: a finite value or a partial sum "
        f"beyond +-{_LARGEST[codec]:g}, {codec}'s largest finite value, which would come back as an "
        f"infinity. {advice}"
    )


def compressed_sum(
    comm: MPI.Intracomm,
    x: np.ndarray,
    codec: str,
    mean: bool = False,
    where: str = "all_reduce",
    nodes: list[list[int]] | None = None,
) -> np.ndarray:
    """The sum (or mean) over ranks of the 1-D float32/float64 host array ``x``, 16 bits on the wire.

    Collective: one ``Alltoall`` and one ``Allgather``. Returns a new array of ``x``'s dtype.
    ``nodes``: ``comm`` is the nodes' leaders, and an overflow names the ranks of ``nodes[leader]``.
    """
    size = comm.Get_size()
    total, overflow, parts = _blocks(comm, x, codec)
    if mean:
        total /= np.float32(size)
    block = total.size
    mine = np.empty(block + 1, dtype=np.uint16)  # the block, then this rank's overflow flag
    mine[:block] = encode(total, codec)
    mine[block] = overflow or _sum_overflows(mine[:block], parts, codec)
    gathered = np.empty((size, block + 1), dtype=np.uint16)
    mpi.allgather(comm, mine, gathered.reshape(-1))
    if gathered[:, block].any():
        _raise_overflow(gathered[:, block], codec, where, nodes)
    return decode(np.ascontiguousarray(gathered[:, :block]).reshape(-1)[: x.size], codec).astype(x.dtype)


def compressed_reduce_scatter(comm: MPI.Intracomm, x: np.ndarray, codec: str, where: str) -> np.ndarray:
    """Rank ``r``'s block (of ``R`` equal blocks) of the sum over ranks of ``x``, in float32.

    One ``Alltoall`` of 16-bit values (each rounded to 16 bits once), then a tiny ``Allreduce``
    of the overflow flags. Returns a float32 array of ``x.size // R``.
    """
    total, overflow, parts = _blocks(comm, x, codec)
    flags = np.zeros(comm.Get_size(), dtype=np.uint8)
    flags[comm.Get_rank()] = overflow or _sum_overflows(encode(total, codec), parts, codec)
    mpi.allreduce(comm, MPI.IN_PLACE, flags, MPI.MAX)
    if flags.any():
        _raise_overflow(flags, codec, where)
    return total
