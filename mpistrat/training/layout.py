"""How a group of an optimizer's flat state is cut into packs, and which elements each rank owns.

A group's elements are cut into packs of at most ``bytes_per_pack`` (one pack when 0).
Unsharded, a pack of gradients is all-reduced in place and every rank updates all of it.
Sharded over R ranks, a pack is R blocks of C elements and rank r owns block r of every
pack: the pack is reduce-scattered, the rank updates its C parameters and their slots,
and the pack's parameters are all-gathered. Slots then take 1/R of the memory, and the
bytes moved are those of one ring all-reduce. After a rank's death the same packs are laid
over the survivors (:meth:`Layout.over`).

>>> lay = Layout.make(size=10, itemsize=4, bytes_per_pack=0, ranks=3, rank=1)
>>> lay.packs, lay.length, lay.owned(0), lay.slot_length
(1, 12, (4, 8), 4)
"""

from __future__ import annotations

import dataclasses

__all__ = ["Layout"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a group's ``size`` elements are cut into packs and which of them this rank updates."""

    size: int
    pack: int  # elements per pack: ranks * per_rank when sharded
    per_rank: int  # elements a rank owns in each pack (the whole pack, unsharded)
    ranks: int  # 1 unsharded
    rank: int
    limit: int = 0  # elements per pack asked for (bytes_per_pack), before rounding to the ranks

    @classmethod
    def make(cls, size: int, itemsize: int, bytes_per_pack: int, ranks: int, rank: int) -> Layout:
        """``ranks`` > 1 shards; every rank computes the same packs from the same numbers."""
        limit = min(size, bytes_per_pack // itemsize) if bytes_per_pack else size
        return cls(size, 0, 0, 1, 0, limit).over(ranks, rank)

    def over(self, ranks: int, rank: int) -> Layout:
        """The same elements and packs asked for, laid over ``ranks`` ranks (after a rank's death)."""
        per_rank = max(1, -(-self.limit // ranks))  # an empty group has no packs
        return Layout(self.size, per_rank * ranks, per_rank, ranks, rank if ranks > 1 else 0, self.limit)

    @property
    def sharded(self) -> bool:
        return self.ranks > 1

    @property
    def packs(self) -> int:
        return -(-self.size // self.pack)

    @property
    def length(self) -> int:
        """The flat buffers' length: padded to whole packs when sharded."""
        return self.packs * self.pack if self.sharded else self.size

    @property
    def slot_length(self) -> int:
        """Elements of each slot this rank holds."""
        return self.packs * self.per_rank if self.sharded else self.size

    def bounds(self, k: int) -> tuple[int, int]:
        return k * self.pack, min((k + 1) * self.pack, self.length)

    def owned(self, k: int, rank: int | None = None) -> tuple[int, int]:
        """The elements of pack ``k`` that ``rank`` (this rank) updates."""
        if not self.sharded:
            return self.bounds(k)
        start = k * self.pack + (self.rank if rank is None else rank) * self.per_rank
        return start, start + self.per_rank

    def slot_start(self, k: int) -> int:
        """Where ``owned(k)`` begins in this rank's slots."""
        return k * self.per_rank if self.sharded else k * self.pack

    def pieces(self, a: int, b: int, rank: int) -> list[tuple[int, int, int]]:
        """``(start, stop, slot_start)`` of the elements in ``[a, b)`` that ``rank`` holds slots for."""
        out = []
        for k in range(a // self.pack, -(-b // self.pack)):
            lo, hi = self.owned(k, rank)
            lo, hi = max(lo, a), min(hi, b)
            if lo < hi:
                out.append((lo, hi, k * self.per_rank + lo - self.owned(k, rank)[0]))
        return out
