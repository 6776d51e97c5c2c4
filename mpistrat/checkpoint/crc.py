"""The checksums of checkpoint data: CRC-32C in the files written now, CRC-32 in earlier ones.

Each rank checksums only the bytes it writes or reads; rank 0 joins the parts of each entry into
the entry's checksum (:meth:`Checksum.joined`, as zlib's ``crc32_combine``, which Python lacks),
the one the algorithm gives over the entry's bytes, so anyone can check a file without mpistrat
(CRC-32C: ``crc32c.crc32c``, ``google_crc32c.value``, tf's own; CRC-32: ``zlib.crc32``).

CRC-32C runs in the CPU's own instruction through the ``crc32c`` wheel (about 10 GB/s, five times
zlib's CRC-32), which lets go of Python's lock while it runs: :func:`in_thread` checksums pieces
beside the MPI-IO that writes or reads them, where a rank has a core to spare (:func:`spare_core`).
Without the wheel, a NumPy version gives the same values, more slowly.

>>> a, b = b"every rank its ", b"share"
>>> f"{CRC32C(b'123456789'):08x}"  # the check value of CRC-32C (iSCSI, RFC 3720)
'e3069283'
>>> CRC32C.combine(CRC32C(a), CRC32C(b), len(b)) == CRC32C(a + b)
True
>>> import zlib
>>> parts = [(0, zlib.crc32(a), len(a)), (len(a), zlib.crc32(b), len(b))]
>>> CRC32.joined(parts, len(a + b)) == zlib.crc32(a + b)
True
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from mpistrat.checkpoint.pieces import Piece

__all__ = ["BY_KEY", "CRC32", "CRC32C", "Checksum", "in_thread", "records", "spare_core"]


class Checksum:
    """A CRC of 32 bits (reflected, initial value and final XOR all ones): ``checksum(data, value)``
    extends ``value``, the checksum of the bytes before ``data``."""

    def __init__(self, key: str, name: str, polynomial: int, update: Callable[[Any, int], int] | None = None):
        self.key = key  # the name of the metadata that holds a file's checksums of this kind
        self.name = name
        self._polynomial = polynomial  # bit-reversed
        self._update = update or self._numpy
        self._x2n = self._powers()
        self._table: np.ndarray | None = None

    def __repr__(self) -> str:
        return self.name

    def __call__(self, data: Any, value: int = 0) -> int:
        return self._update(data, value)

    def combine(self, crc1: int, crc2: int, len2: int) -> int:
        """The checksum of ``A + B`` from ``crc1`` of A, ``crc2`` of B and B's length in bytes."""
        return self._multiply(self._x_to_8n(len2), crc1) ^ (crc2 & 0xFFFFFFFF)

    def joined(self, parts: list[tuple[int, int, int]], total: int) -> int | None:
        """The checksum of ``total`` bytes from ``(start, crc, length)`` parts that tile them, or None
        when they do not (a gap or an overlap: a part is missing or was counted twice)."""
        crc, at = 0, 0
        for start, part, length in sorted(p for p in parts if p[2]):  # empty parts change nothing
            if start != at:
                return None
            crc, at = self.combine(crc, part, length), at + length
        return crc if at == total else None

    # -- arithmetic modulo the polynomial (bit-reversed: bit 31 is x^0) -------------------------------

    def _multiply(self, a: int, b: int) -> int:
        m, product = 1 << 31, 0
        while True:
            if a & m:
                product ^= b
                if not a & (m - 1):
                    return product
            m >>= 1
            b = (b >> 1) ^ self._polynomial if b & 1 else b >> 1

    def _powers(self) -> list[int]:
        """x^(2^k) modulo the polynomial, k = 0..31."""
        table, p = [], 1 << 30  # x^1
        for _ in range(32):
            table.append(p)
            p = self._multiply(p, p)
        return table

    def _x_to_8n(self, n: int) -> int:
        """x^(8 n): what appending ``n`` zero bytes multiplies a checksum by."""
        p, k = 1 << 31, 3  # x^0; 8 n = n 2^3
        while n:
            if n & 1:
                p = self._multiply(self._x2n[k & 31], p)
            n >>= 1
            k += 1
        return p

    # -- the NumPy version, where no compiled one is installed ----------------------------------------

    _LANES = 1 << 14

    def _numpy(self, data: Any, value: int) -> int:
        """The bytes in 16384 lanes updated side by side, a byte of each per step, their checksums
        then joined pairwise: NumPy's speed, where a byte at a time in Python would take minutes."""
        if self._table is None:
            t = np.arange(256, dtype=np.uint32)
            for _ in range(8):
                t = np.where(t & 1, (t >> 1) ^ np.uint32(self._polynomial), t >> 1)
            self._table = t
        table = self._table
        flat = np.frombuffer(data, np.uint8)
        m = flat.size // self._LANES
        crc = value
        if m:
            lanes = flat[: m * self._LANES].reshape(self._LANES, m)
            register = np.full(self._LANES, 0xFFFFFFFF, np.uint32)
            for a in range(0, m, 256):  # 256 steps at a time, turned so that each step reads a row
                block = np.ascontiguousarray(lanes[:, a : a + 256].T)
                for row in block:
                    register = table[(register ^ row) & 0xFF] ^ (register >> 8)
            crcs, length = register ^ np.uint32(0xFFFFFFFF), m
            while crcs.size > 1:
                crcs = self._multiply_each(self._x_to_8n(length), crcs[0::2]) ^ crcs[1::2]
                length *= 2
            crc = self.combine(crc, int(crcs[0]), m * self._LANES)
        tail = 0xFFFFFFFF
        for byte in flat[m * self._LANES :].tolist():
            tail = int(table[(tail ^ byte) & 0xFF]) ^ (tail >> 8)
        return self.combine(crc, tail ^ 0xFFFFFFFF, flat.size - m * self._LANES)

    def _multiply_each(self, a: int, b: np.ndarray) -> np.ndarray:
        """``a * b`` for every element of ``b``."""
        product, polynomial = np.zeros_like(b), np.uint32(self._polynomial)
        for bit in range(31, -1, -1):
            if a >> bit & 1:
                product ^= b
            b = np.where(b & 1, (b >> 1) ^ polynomial, b >> 1)
        return product


def _compiled_crc32c() -> Callable[[Any, int], int] | None:
    try:
        import crc32c
    except ImportError:
        return None
    return crc32c.crc32c


CRC32 = Checksum("crc32", "CRC-32", 0xEDB88320, zlib.crc32)
CRC32C = Checksum("crc32c", "CRC-32C", 0x82F63B78, _compiled_crc32c())
BY_KEY = {c.key: c for c in (CRC32, CRC32C)}


def records(pieces: Iterable[Piece], checksum: Checksum = CRC32C) -> list[tuple[str, int, int, int]]:
    """``(entry, start, crc, length)`` of each of ``pieces``: what rank 0 joins into each entry's."""
    return [(p.entry, p.start, checksum(p.memory.data), p.nbytes) for p in pieces]


_worker: ThreadPoolExecutor | None = None


def in_thread(fn: Callable[[], Any], beside: bool = True) -> Future[Any]:
    """``fn()`` in the checksum thread (one per process; calls run in the order given), while the
    caller moves the bytes: the checksums release Python's lock, MPI-IO too. With ``beside`` false,
    ``fn()`` runs here and now (its result, or its error, in the future returned)."""
    global _worker
    if not beside:
        done: Future[Any] = Future()
        try:
            done.set_result(fn())
        except Exception as exc:
            done.set_exception(exc)
        return done
    if _worker is None:
        _worker = ThreadPoolExecutor(1, thread_name_prefix="mpistrat-checksum")
    return _worker.submit(fn)


def spare_core(hosts: Sequence[str], rank: int) -> bool:
    """Whether rank ``rank`` has a second core of its own, given every rank's host (``hosts``; none
    known: alone on its node): where the ranks take every core (one bound to each, or more ranks
    than cores), a checksum thread only takes turns with them, and the switches cost more than they
    hide (docs/performance.md). A restore checksums in line there, a save while it flushes.
    """
    ranks_here = hosts.count(hosts[rank]) if hosts else 1
    cores = os.cpu_count() or 1
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    unbound = mine >= cores  # every rank of the node may run on every core: they share them
    return (mine // ranks_here if unbound else mine) >= 2
