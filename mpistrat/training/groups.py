"""An optimizer's variables of one dtype in flat buffers, with their slots and staging buffers.

``optimizer_state.FlatState.build`` makes one :class:`Group` per dtype and array module; the pack
step (``pack_step.py``) reads and writes it, and its :class:`~mpistrat.training.layout.Layout` says
how it is cut into packs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from mpistrat.training import placement
from mpistrat.training.flat_storage import FlatBuffer
from mpistrat.values import local_variable

if TYPE_CHECKING:
    from mpistrat.training.layout import Layout
    from mpistrat.training.variables import Variable

__all__ = ["Group", "Staging"]


class Group:
    """Variables of one dtype and array module from one ``build``, their slots and buffers."""

    def __init__(
        self,
        variables: list[Variable],
        slot_variables: dict[str, list[Variable]] | None,
        slot_names: tuple[str, ...],
        layout: Layout,
    ):
        self.variables = variables
        self.layout = layout
        self.params = FlatBuffer([local_variable(v) for v in variables], layout.length)
        xp, dtype = self.params.xp, self.params.dtype
        self.xp, self.dtype = xp, dtype
        self.slots: dict[str, Any] = {}  # FlatBuffer (unsharded) or this rank's array (sharded)
        for name in slot_names:
            if slot_variables is None:  # sharded (at one rank: this rank's part is all of it)
                self.slots[name] = placement.zeros(layout.slot_length, dtype, xp)
            else:
                self.slots[name] = FlatBuffer([local_variable(s) for s in slot_variables[name]])
        self.staging = placement.empty(layout.pack, dtype, xp)
        self.rewritten = False  # slots written outside a step (a restore): other ranks' copies are stale
        self._rows: Any = None  # [K, pack]: an accumulation cycle's packs, for an exact mean
        self.stream: Staging | None = None  # a streamed step's staging (training/overlap.py makes it)

    def row_staging(self, rows: int) -> Any:
        """A ``[rows, pack]`` staging buffer (made at the first exact accumulated step, then kept)."""
        if self._rows is None or self._rows.shape[0] != rows:
            self._rows = placement.empty(rows * self.layout.pack, self.dtype, self.xp).reshape(rows, -1)
        return self._rows

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds besides the parameters: slots and the staging buffer."""
        held = [s.array if isinstance(s, FlatBuffer) else s for s in self.slots.values()]
        held.append(self.staging)
        if self._rows is not None:
            held.append(self._rows)
        if self.stream is not None:
            held.append(self.stream.buffer)
        return sum(int(a.nbytes) for a in held)

    def claim_slots(self) -> list[Any]:
        """Each slot's array in ``slot_names`` order, claimed for an in-place write."""
        return [s.claim() if isinstance(s, FlatBuffer) else s for s in self.slots.values()]


@dataclasses.dataclass
class Staging:
    """A group's gradients in a streamed step, every pack of them at once, its pieces and which
    variables each holds (``overlap.staging_of`` makes it)."""

    packed: bool  # one piece per pack
    buffer: Any  # the layout's length
    pieces: list[tuple[int, int, int]]  # (pack, a, b): elements a:b of the pack
    members: list[list[int]]  # per piece: the group's variables with elements in it
    pieces_of: list[list[int]]  # per variable: the pieces it has elements in
