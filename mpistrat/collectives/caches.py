"""What one ``Collectives`` object remembers between calls, in one place.

A training loop repeats the same calls with the same structures, dtypes and shapes, so
flattening plans, pack plans and fingerprints are worth keeping. Every cache is a
:class:`Memo` with one rule: at its limit it forgets everything, so a loop's keys come back
at once while a stream of new keys cannot grow it. Each ``Collectives`` owns one
:class:`Caches`; its collectives run one thread at a time (the watchdog refuses a second
thread), so they need no lock, and a test can start from empty ones with ``clear()``.

>>> memo = Memo(limit=2)
>>> memo.keep("a", 1), memo.keep("b", 2), memo.keep("c", 3), sorted(memo)
(1, 2, 3, ['c'])
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Caches", "Memo"]


class Memo(dict[Any, Any]):
    """A dict that forgets everything when it holds ``limit`` entries and one more comes."""

    __slots__ = ("limit",)

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def keep(self, key: Any, value: Any) -> Any:
        """Store ``value`` under ``key`` (clearing first when full); return ``value``."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


class Caches:
    """One ``Collectives`` object's caches (see the module docstring)."""

    def __init__(self) -> None:
        self.flat = Memo(256)  # (container type, keys or length) -> (treespec, leaf order)
        self.plans = Memo(256)  # treespec -> its last (op, bytes_per_pack, signature, fingerprint, packs)
        self.packs = Memo(256)  # (bytes_per_pack, signature) -> pack plan
        self.arrays = Memo(256)  # one array's shape -> all_reduce's (reduce_op, dtype, type, plan) for it
        self.codes = Memo(4096)  # what a fingerprint covers -> its 62-bit code
        self.buffers: list[np.ndarray] = []  # large result buffers to recycle (packing.empty)
        # strategy.run's last result: (type, length or None for a leaf, structure, code)
        self.last_result: tuple[Any, int | None, Any, int] | None = None

    def clear(self) -> None:
        for memo in (self.flat, self.plans, self.packs, self.arrays, self.codes):
            memo.clear()
        self.buffers.clear()
        self.last_result = None
