"""Who writes and reads which bytes of a checkpoint file: each byte by one rank, in few calls.

A :class:`Piece` is a byte range of one entry and the memory it is written from or read into.
Values every rank holds whole (mirrored variables, unsharded slots) are laid end to end and
split evenly (:func:`share`): each rank writes, and on restore reads, one run of about 1/R of
their bytes. A sharded slot's parts are written and read by the ranks that hold them.
:func:`calls` joins pieces that follow each other in the file into one MPI-IO call each, of
at most ``limit`` bytes (MPI counts are C ints); :func:`rounds` joins them whatever lies between,
for calls that see the file through a view of their runs.

>>> import numpy as np
>>> share(10, 3, 1), share(10, 3, 2)
((3, 6), (6, 10))
>>> a, b = Piece("a", 0, 8, np.zeros(4, np.uint8)), Piece("b", 0, 12, np.zeros(4, np.uint8))
>>> [[(p.entry, p.offset, p.nbytes) for p in call] for call in calls([b, a], limit=6)]
[[('a', 8, 4), ('b', 12, 2)], [('b', 14, 2)]]
>>> c = Piece("c", 0, 20, np.zeros(4, np.uint8))
>>> [[(p.entry, p.offset, p.nbytes) for p in call] for call in rounds([c, b, a], limit=10)]
[[('a', 8, 4), ('b', 12, 4), ('c', 20, 2)], [('c', 22, 2)]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["CALL_LIMIT", "Piece", "bytes_of", "calls", "joined", "rounds", "share", "spans_of_share"]

CALL_LIMIT = 1 << 30  # bytes per MPI-IO call: below MPI's 2**31 count limit on every MPI family


@dataclasses.dataclass
class Piece:
    """Bytes ``[start, start + memory.size)`` of entry ``entry``, at ``offset`` in the file."""

    entry: str
    start: int
    offset: int
    memory: np.ndarray  # 1-D uint8: the bytes to write, or where the bytes read go

    @property
    def nbytes(self) -> int:
        return int(self.memory.size)

    def split(self, at: int) -> tuple[Piece, Piece]:
        """This piece's first ``at`` bytes and the rest."""
        head = Piece(self.entry, self.start, self.offset, self.memory[:at])
        return head, Piece(self.entry, self.start + at, self.offset + at, self.memory[at:])


def share(total: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s bytes ``[lo, hi)`` of ``total`` split evenly over ``size`` ranks."""
    return total * rank // size, total * (rank + 1) // size


def spans_of_share(sizes: list[int], lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
    """``(index, start, stop)``: the parts of arrays of ``sizes`` bytes, laid end to end, in
    bytes ``[lo, hi)`` of them.

    >>> list(spans_of_share([4, 0, 6], 2, 7))
    [(0, 2, 4), (2, 0, 3)]
    """
    at = 0
    for i, size in enumerate(sizes):
        a, b = max(lo, at), min(hi, at + size)
        if a < b:
            yield i, a - at, b - at
        at += size


def bytes_of(array: Any) -> np.ndarray:
    """A host array's bytes in C order as a 1-D uint8 array: a view when it is C-contiguous
    (0-d included), else a copy."""
    array = np.asarray(array)
    flat = array.reshape(-1) if array.flags.c_contiguous else np.ascontiguousarray(array).reshape(-1)
    return flat.view(np.uint8)


def joined(arrays: list[np.ndarray]) -> np.ndarray | None:
    """1-D uint8 ``arrays`` that lie end to end in one C-contiguous array, as one view of it; None
    when they do not (a sharded slot's parts, a flat buffer's variables in order, are joined).

    >>> base = np.arange(8, dtype=np.uint8)
    >>> joined([base[:3], base[3:5]]).tolist(), joined([base[:3], base[4:5]])
    ([0, 1, 2, 3, 4], None)
    """
    first = arrays[0]
    if len(arrays) == 1:
        return first
    base = first.base
    if not isinstance(base, np.ndarray) or not base.flags.c_contiguous:
        return None
    start = _address(first) - _address(base)
    at = start
    for array in arrays:
        if array.base is not base or _address(array) != _address(base) + at:
            return None
        at += array.size
    return base.reshape(-1).view(np.uint8)[start:at]


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def calls(pieces: list[Piece], limit: int | None = None) -> list[list[Piece]]:
    """``pieces`` in file order, grouped into calls: each call a run of consecutive bytes of the
    file, at most ``limit`` of them (default :data:`CALL_LIMIT`; a longer piece is split)."""
    return _grouped(pieces, limit, contiguous=True)


def rounds(pieces: list[Piece], limit: int | None = None) -> list[list[Piece]]:
    """``pieces`` in file order, grouped into calls of at most ``limit`` bytes (default
    :data:`CALL_LIMIT`; a longer piece is split), whatever lies between them in the file."""
    return _grouped(pieces, limit, contiguous=False)


def _grouped(pieces: list[Piece], limit: int | None, contiguous: bool) -> list[list[Piece]]:
    limit = CALL_LIMIT if limit is None else limit
    out: list[list[Piece]] = []
    size, end = 0, -1
    for piece in sorted((p for p in pieces if p.nbytes), key=lambda p: p.offset):
        while piece.nbytes:
            room = limit - size if out and (piece.offset == end or not contiguous) else 0
            if room <= 0:
                out.append([])
                size, room = 0, limit
            head, piece = piece.split(min(room, piece.nbytes))
            out[-1].append(head)
            size, end = size + head.nbytes, head.offset + head.nbytes
    return out
