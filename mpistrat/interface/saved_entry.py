"""What a checkpoint saves of each value it tracks and how it restores it: the entries' protocol.

A checkpoint file holds arrays by name. Each value a ``Checkpoint`` tracks is an entry of one of
three kinds, told apart by ``holding`` (where the value lives among the ranks, which decides who
writes and who reads which bytes):

- ``WHOLE`` (:class:`WholeEntry`): every rank holds the whole value (variables, an unsharded
  optimizer's slots and step counter). The ranks write even shares of these values laid end to
  end, each from its own copy, and a restore gathers them back.
- ``PARTS`` (:class:`PartsEntry`): each rank holds parts of it (a sharded optimizer's slots, a
  gradient accumulation cycle's rows): each part is written and read by the rank that holds it.
- ``POSITION`` (:class:`PositionEntry`): a distributed dataset's or iterator's position, a row
  of the file's metadata, checked against the dataset before anything is restored.

Each kind implements its protocol where it lives: ``training/saved_variable.py``
(``SavedVariable``), ``training/sharded_slot.py`` (``ShardedSlot``), ``training/accumulation.py``
(``RankShare``), ``input/position.py`` (``InputPosition``); the checkpoint package names only
this module. An entry's name is its key in the checkpoint's mapping of entries.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

import numpy as np

__all__ = [
    "PARTS",
    "POSITION",
    "WHOLE",
    "FlatMemory",
    "PartsEntry",
    "PositionEntry",
    "SavedEntry",
    "WholeEntry",
]

WHOLE: Literal["whole"] = "whole"
PARTS: Literal["parts"] = "parts"
POSITION: Literal["position"] = "position"


class FlatMemory(Protocol):
    """Memory that several whole entries share, end to end (an optimizer's flat buffer)."""

    @property
    def dtype(self) -> np.dtype: ...

    def claim(self) -> Any:
        """The array, to be written in place (copied first if something else holds a view of it)."""


class WholeEntry(Protocol):
    """A value every rank holds whole."""

    @property
    def holding(self) -> Literal["whole"]: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    @property
    def compared(self) -> bool:
        """Whether the ranks' copies must be the same, so a save compares them (not where the value
        saved is an aggregate of different copies: a sync-on-read variable's)."""

    @property
    def place(self) -> tuple[FlatMemory, int, int] | None:
        """Where it lies in memory shared with other entries: that memory, the creation order of its
        first variable (the same on every rank) and the element it starts at; None elsewhere. A save
        lays such entries out in this order; a restore gathers neighbours straight into the memory."""

    def saved_value(self) -> Any:
        """The value to save (collective where it is an aggregate)."""

    def memory(self) -> AbstractContextManager[Any]:
        """Its own array, to restore into in place (it holds the bytes once the context ends), or
        None where it takes a value only through :meth:`assign`."""

    def assign(self, value: Any) -> object: ...


class PartsEntry(Protocol):
    """A value of which each rank holds parts."""

    @property
    def holding(self) -> Literal["parts"]: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    @property
    def layout(self) -> tuple[int, str, int, str, int]:
        """Where a file lays it out among the parts entries, the same on every rank: the creation
        order of its variables, the dtype, 0 for an optimizer's slot (1 for an accumulation row),
        the slot's name and its first element. Ordered so, the parts a rank holds of one flat
        buffer follow each other in the file."""

    def local_parts(self, writable: bool = False) -> list[tuple[int, Any]]:
        """This rank's parts, ``(first element in the flattened value, array)``; ``writable``: a
        restore writes into them."""


class PositionEntry(Protocol):
    """A dataset's position: a row of int64 in the file's metadata."""

    @property
    def holding(self) -> Literal["position"]: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    @property
    def owner(self) -> object:
        """Whoever made the dataset: a checkpoint asks it whose ranks take part."""

    def mismatch(self, dtype: np.dtype, shape: tuple[int, ...]) -> str | None:
        """What is wrong with a saved row of ``dtype`` and ``shape`` for this position, if anything."""

    def saved(self) -> tuple[np.ndarray, dict[str, int | None] | None]:
        """The row to save and, where it is one for every rank, the same in words (collective)."""

    def check(self, value: Any) -> Any:
        """A saved row checked against the dataset, for :meth:`apply` (collective)."""

    def apply(self, saved: Any) -> None:
        """Move to a position :meth:`check` accepted (on this rank)."""


SavedEntry = WholeEntry | PartsEntry | PositionEntry  # what a checkpoint saves: `holding` says which
