"""A dataset's position as a checkpoint holds it: two int64, and what they say about the dataset.

Earlier versions wrote ``[epoch, batches taken]``, both below ``2**32``. A batch count resumes
at the wrong example when the batch size changed (tf's ``GLOBAL = PER_REPLICA *
num_replicas_in_sync`` at another number of ranks), so a row is now::

    [epoch + 2**32 * tag, examples taken]

``tag`` (31 bits) has bit 30 set, so a row of this layout is never read as the earlier one, and
two 15-bit digests of what the examples were: the order a pass visits them in (an
``ArrayDataset``'s shuffle, seed and sharding) and how many a pass has. A digest is 0 where the
dataset cannot say (another iterable: its order is its own, and its batches are not counted
until read). A restore compares the digests it can and refuses a dataset that changed, saying
which digest differs; two different datasets share a digest with probability 2**-15.

>>> row = encode(3, 40, Identity(order=5, length=9))
>>> decode(row)
Saved(epoch=3, batches=None, examples=40, identity=Identity(order=5, length=9))
>>> decode([3, 2])
Saved(epoch=3, batches=2, examples=None, identity=None)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mpistrat.collectives.fingerprint import hash64

__all__ = ["Identity", "Saved", "decode", "digest", "encode"]

_EPOCH_BITS = 32
_MARK = 1 << 30
_DIGEST = (1 << 15) - 1


@dataclasses.dataclass(frozen=True)
class Identity:
    """Digests of a dataset's order and of its examples per pass (0: not known)."""

    order: int = 0
    length: int = 0

    def differences(self, saved: Identity) -> list[str]:
        """What differs from ``saved``, where both know it."""
        out = []
        if self.order and saved.order and self.order != saved.order:
            out.append("the order of its examples (shuffle, seed or sharding)")
        if self.length and saved.length and self.length != saved.length:
            out.append("its examples per pass")
        return out


@dataclasses.dataclass(frozen=True)
class Saved:
    """A decoded row: the pass, and either the batches (earlier layout) or the examples taken in it."""

    epoch: int
    batches: int | None
    examples: int | None
    identity: Identity | None


def digest(*what: Any) -> int:
    """A 15-bit digest of ``what``, never 0 (0 means not known)."""
    return hash64(repr(what)) % _DIGEST + 1


def encode(epoch: int, examples: int, identity: Identity) -> list[int]:
    """The row of pass ``epoch`` after ``examples`` examples of a dataset of ``identity``."""
    tag = _MARK | identity.order << 15 | identity.length
    return [epoch + (tag << _EPOCH_BITS), examples]


def decode(row: Any) -> Saved:
    """A row of either layout. Values out of range are left for the caller's checks (an earlier
    row's negative epoch stays negative)."""
    first, second = int(row[0]), int(row[1])
    if first < 0 or not first >> (_EPOCH_BITS + 30):
        return Saved(first, second, None, None)
    tag = first >> _EPOCH_BITS
    identity = Identity(order=tag >> 15 & _DIGEST, length=tag & _DIGEST)
    return Saved(first & ((1 << _EPOCH_BITS) - 1), None, second, identity)
