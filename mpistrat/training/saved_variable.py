"""A variable as a checkpoint entry that every rank holds whole (``interface/saved_entry.py``).

>>> import numpy as np
>>> from mpistrat.training.variables import Variable
>>> entry = SavedVariable(Variable(np.arange(3.0)))
>>> entry.holding, entry.shape, entry.compared, entry.place, entry.saved_value()
('whole', (3,), True, None, array([0., 1., 2.]))
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Literal

import numpy as np

from mpistrat.interface.saved_entry import WHOLE, FlatMemory, PartsEntry
from mpistrat.training.optimizer_state import storage_place
from mpistrat.training.sharded_slot import ShardedSlot
from mpistrat.training.variables import Variable, VariableSynchronization, Writable
from mpistrat.values import local_variable

__all__ = ["SavedVariable", "saved_slot"]


class SavedVariable:
    """``variable`` as a :class:`~mpistrat.interface.saved_entry.WholeEntry`: a sync-on-read one
    saves its aggregate (not compared between ranks) and restores through ``assign``; the others
    restore straight into their own memory."""

    holding: Literal["whole"] = WHOLE

    def __init__(self, variable: Variable):
        self.variable = variable
        self._on_read = getattr(variable, "synchronization", None) is VariableSynchronization.ON_READ

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.variable.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.variable.dtype)

    @property
    def compared(self) -> bool:
        return not self._on_read

    @property
    def place(self) -> tuple[FlatMemory, int, int] | None:
        return storage_place(self.variable)

    def saved_value(self) -> Any:
        return self.variable.value()

    def memory(self) -> AbstractContextManager[Any]:
        if self._on_read:
            return contextlib.nullcontext(None)
        return Writable(local_variable(self.variable))

    def assign(self, value: Any) -> object:
        return self.variable.assign(value)


def saved_slot(slot: Variable | ShardedSlot) -> SavedVariable | PartsEntry:
    """An optimizer's slot as a checkpoint entry: a sharded one is one already."""
    return slot if isinstance(slot, ShardedSlot) else SavedVariable(slot)
