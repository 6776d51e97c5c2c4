"""CRC-32 of a whole from the CRC-32s of its parts, as zlib's ``crc32_combine`` (which Python lacks).

Each rank checksums only the bytes it writes or reads; rank 0 joins the parts of each entry
into the entry's CRC-32, the one ``zlib.crc32`` gives over the entry's bytes, so anyone can
check a file without mpistrat.

>>> import zlib
>>> a, b = b"every rank its ", b"share"
>>> combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
True
>>> joined([(0, zlib.crc32(a), len(a)), (len(a), zlib.crc32(b), len(b))], len(a + b)) == zlib.crc32(a + b)
True
"""

from __future__ import annotations

__all__ = ["combine", "joined"]

_POLY = 0xEDB88320  # CRC-32's polynomial, bit-reversed


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the polynomial (bit-reversed: bit 31 is x^0)."""
    m, product = 1 << 31, 0
    while True:
        if a & m:
            product ^= b
            if not a & (m - 1):
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    """x^(2^k) modulo the polynomial, k = 0..31."""
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multiply(p, p)
    return table


_X2N = _powers()


def _x_to_8n(n: int) -> int:
    """x^(8 n) modulo the polynomial: what appending ``n`` zero bytes multiplies a CRC by."""
    p, k = 1 << 31, 3  # x^0; 8 n = n 2^3
    while n:
        if n & 1:
            p = _multiply(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1`` of A, ``crc2`` of B and B's length in bytes."""
    return _multiply(_x_to_8n(len2), crc1) ^ (crc2 & 0xFFFFFFFF)


def joined(parts: list[tuple[int, int, int]], total: int) -> int | None:
    """The CRC-32 of ``total`` bytes from ``(start, crc, length)`` parts that tile them, or None
    when they do not (a gap or an overlap: a part is missing or was counted twice)."""
    crc, at = 0, 0
    for start, part, length in sorted(p for p in parts if p[2]):  # empty parts change nothing
        if start != at:
            return None
        crc, at = combine(crc, part, length), at + length
    return crc if at == total else None
