"""Unbatched elements given to ``experimental_distribute_dataset``: one per replica per step.

A dataset of unbatched elements (``range(10)``, a generator of scalars, ``{"image": (28, 28),
"label": ()}`` examples: an element with a 0-d leaf, the rule :func:`~mpistrat.input.batches.examine`
applies) has no batch dimension to split. At one replica tf passes each element through whole, and
so does this. At ``R`` replicas each step deals the next ``R`` elements, one per replica in rank
order, so replica ``r`` gets elements ``r, r + R, r + 2R, ...``: tf's order when it shards a dataset
by element over its workers. Every element reaches exactly one replica; when the data ends inside a
step, the replicas past the end get tf's dummy element under ``InputOptions(uneven="pad")`` (zeros,
a scalar ``0`` for a scalar leaf), the step is dropped under ``"drop"``, and ``"error"`` raises, as for
a short global batch.

>>> from mpistrat.input.batches import examine
>>> group = Elements([examine(i, "example", unbatched=True) for i in (7, 8)])
>>> group.size, int(group.take(1, 3)), int(group.take(2, 3))
(2, 8, 0)
"""

from __future__ import annotations

from typing import Any

from mpistrat.collectives.fingerprint import code_of
from mpistrat.input.batches import Batch, empty_batch
from mpistrat.input.batches import fingerprint as batch_fingerprint

__all__ = ["Elements"]


class Elements:
    """One step's unbatched elements, element ``r`` for replica ``r`` (fewer than the replicas at the end)."""

    def __init__(self, elements: list[Batch]):
        self.elements = elements

    @property
    def size(self) -> int:
        """The number of elements (examples) in the step."""
        return len(self.elements)

    @property
    def spec(self) -> Any:
        """Each replica's element spec: the first element's, with the leaves' whole shapes."""
        return self.elements[0].spec

    def fingerprint(self, memo: Any) -> int:
        """A code of every element's structure, dtypes and shapes (the step's handshake compares it)."""
        codes = [batch_fingerprint(e.treespec, e.leaves, True, memo, batched=False) for e in self.elements]
        return code_of("unbatched elements", *codes, memo=memo)

    def take(self, replica: int, num_replicas: int) -> Any:
        """Replica ``replica``'s element, or tf's dummy element when the step has none for it."""
        del num_replicas  # one element per replica, in rank order
        if replica < len(self.elements):
            return self.elements[replica].value
        return empty_batch(self.spec)

    def describe(self) -> list[tuple[str, str, Any]]:
        """What this rank read, for a mismatch explanation: each element's leaves."""
        return [
            (f"element {i}", str(leaf.dtype), tuple(leaf.shape))
            for i, element in enumerate(self.elements)
            for leaf in element.leaves
        ]
