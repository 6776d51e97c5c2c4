"""A slot of a sharded optimizer: each rank holds the part for the elements it updates.

``optimizer.get_slot(var, name)`` returns one when the optimizer was made with
``shard_state=True``. Reading the whole slot is collective; its shape, dtype and this
rank's parts are not.

>>> import mpistrat, numpy as np
>>> w = mpistrat.Variable(np.zeros(3))
>>> opt = mpistrat.optimizers.SGD(0.1, momentum=0.9, shard_state=True)
>>> _ = opt.apply_gradients([(np.ones(3), w)])
>>> slot = opt.get_slot(w, "momentum")
>>> slot.shape, slot.numpy()
((3,), array([-0.1, -0.1, -0.1]))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from mpistrat.collectives.fingerprint import checksum
from mpistrat.comm import packing
from mpistrat.errors import InvalidArgumentError, MpistratError
from mpistrat.interface.saved_entry import PARTS
from mpistrat.training.optimizer_state import creation_order

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives
    from mpistrat.training.groups import Group

__all__ = ["ShardedSlot"]


class ShardedSlot:
    """A slot of a sharded optimizer: each rank holds the part of it for the elements it updates.

    ``shape``, ``dtype`` and ``name`` answer locally. :meth:`numpy` and :meth:`value` are
    collective (every rank calls them): one all-gather of this slot's bytes assembles the whole
    value on every rank. :meth:`assign` takes a whole value (the same on every rank: checked in
    one handshake) and keeps this rank's part.
    """

    def __init__(self, group: Group, index: int, slot: str, name: str, collectives: Collectives):
        self._group, self._index, self._slot = group, index, slot
        self._name, self._collectives = name, collectives
        self._shape = group.params.shapes[index]

    name = property(lambda self: self._name, doc="The slot's name, ``<variable>/<slot>``.")
    shape = property(lambda self: self._shape)
    dtype = property(lambda self: self._group.dtype)
    trainable = False

    def _pieces(self, rank: int) -> list[tuple[int, int, int]]:
        a, b = self._group.params.spans[self._index]
        return [(lo - a, hi - a, at) for lo, hi, at in self._group.layout.pieces(a, b, rank)]

    holding: Literal["parts"] = PARTS  # a checkpoint entry (interface/saved_entry.py)

    @property
    def layout(self) -> tuple[int, str, int, str, int]:
        """Where a checkpoint lays this slot out: ``(group, dtype, 0, slot name, first element)``, the
        same on every rank. Ordered by it, a group's slots of one name tile the group's flat buffer,
        so each rank's parts of them follow each other in the file."""
        group = self._group
        return (
            creation_order(group.variables[0]),
            group.dtype.str,
            0,
            self._slot,
            group.params.spans[self._index][0],
        )

    def local_parts(self, writable: bool = False) -> list[tuple[int, Any]]:
        """This rank's parts: ``(offset in the flattened slot, array)`` pairs; no communication.
        ``writable``: the caller writes them (a restore), so the copies kept by other ranks where a
        death is survivable (``shard_copies.py``) are made again at the next step."""
        if writable:
            self._group.rewritten = True
        slot = self._group.slots[self._slot]
        return [(lo, slot[at : at + hi - lo]) for lo, hi, at in self._pieces(self._group.layout.rank)]

    def value(self) -> Any:
        """The whole slot on every rank (collective: one all-gather of its bytes)."""
        xp = self._group.xp
        mine = [part for _, part in self.local_parts()]
        local = xp.concatenate(mine) if mine else xp.zeros(0, self.dtype)
        gathered = self._collectives.all_gather(local, 0, kind=f"slot value ({self._name})")
        out = xp.empty(int(np.prod(self._shape)), self.dtype)
        at = 0
        for rank in range(self._group.layout.ranks):
            for lo, hi, _ in self._pieces(rank):
                out[lo:hi] = gathered[at : at + hi - lo]
                at += hi - lo
        return out.reshape(self._shape)

    def numpy(self) -> np.ndarray:
        """A NumPy copy of :meth:`value` (collective)."""
        value = self.value()
        return np.asarray(value) if packing.array_module(value) is np else value.get()

    def read_value(self) -> Any:
        return self.value()

    def assign(self, value: Any) -> ShardedSlot:
        """Set the whole slot from ``value``, the same on every rank: this rank keeps its part.

        Collective: the ranks compare a checksum of ``value`` (while the check is on), so a value
        that differs between ranks, or is of another shape on one, raises on every rank and
        writes nothing.
        """
        xp, slot = self._group.xp, self._group.slots[self._slot]
        flat: Any = None
        error: MpistratError | None = None
        code = 0
        try:
            array = xp.asarray(value, dtype=self.dtype)
            if tuple(array.shape) != self._shape:
                raise InvalidArgumentError(
                    f"{self._name}.assign: expected a value of shape {self._shape}; got {tuple(array.shape)}"
                )
            flat = array.reshape(-1)
            code = checksum(flat)
        except (TypeError, ValueError) as exc:
            error = InvalidArgumentError(
                f"{self._name}.assign: cannot make a {self.dtype} array of it: {exc}"
            )
        except MpistratError as exc:
            error = exc
        self._collectives.agree(
            f"assign({self._name})",
            fingerprint=code,
            describe=lambda: {
                "leaves": [(repr(self._name), f"value with checksum {code:016x}", self._shape)],
                "advice": _SAME_VALUE.format(name=self._name),
            },
            error=error,
        )
        for lo, hi, at in self._pieces(self._group.layout.rank):
            slot[at : at + hi - lo] = flat[lo:hi]
        self._group.rewritten = True
        return self

    def __repr__(self) -> str:
        return f"<mpistrat.ShardedSlot {self._name!r} shape={self._shape} dtype={self.dtype}>"


_SAME_VALUE = (
    "{name}.assign takes the whole slot, the same value on every rank, and each rank keeps its part: "
    "different values would leave a slot that no rank's value describes. Assign a value every rank "
    "computes alike (e.g. one reduced with strategy.reduce)."
)
