"""The user's iterable of batches, read from a saved position; peeking at it loses nothing.

>>> source = Source([1, 2, 3], "example")
>>> source.peek(), source.position
(1, (0, 0))
>>> it, serial = source.open()
>>> next(it), next(it)
(1, 2)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from mpistrat.errors import InvalidArgumentError, MpistratError
from mpistrat.input.arrays import ArrayDataset
from mpistrat.input.position import Position, check_position

__all__ = ["END", "UNKNOWN", "Source", "wrap_user_error"]

END: Any = type("End", (), {"__repr__": lambda self: "<end of data>"})()  # a pass has no more batches
UNKNOWN: Any = type("Unknown", (), {"__repr__": lambda self: "<unknown>"})()  # not read (or agreed) yet


class Source:
    """The user's iterable of batches and its :class:`Position`; peeking at the first batch does not lose it.

    A peek opens a pass and keeps it (with the batch it read) for the next
    :meth:`open`, so a one-shot generator, or a dataset whose every pass differs
    (a reshuffle per epoch), is read exactly as if nobody had peeked. An
    :class:`~mpistrat.ArrayDataset` shares its own position, and a pass opened at
    a step skips there by index arithmetic, gathering checked :class:`~mpistrat.input.batches.Batch` objects;
    any other iterable skips by reading and dropping batches.
    """

    def __init__(self, iterable: Iterable[Any], where: str):
        if not hasattr(type(iterable), "__iter__"):
            raise InvalidArgumentError(
                f"{where}: expected an iterable of batches (a list, a generator, a data loader); "
                f"got {type(iterable).__name__}"
            )
        self.iterable = iterable
        self.where = where
        self._arrays = iterable if isinstance(iterable, ArrayDataset) else None
        self._position = Position() if self._arrays is None else self._arrays._position
        self._stash: tuple[Any, Iterator[Any], int] | None = None
        self._rest: Iterator[Any] | None = None  # a one-shot iterator's batches, a peeked one first

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, step)``: the pass in progress (or the next) and the batches taken in it."""
        return self._position.epoch, self._position.step

    def open(self) -> tuple[Iterator[Any], int]:
        """A pass's iterator, and the serial that :meth:`took` and :meth:`ended` count it by."""
        if self._stash is not None:
            first, it, serial = self._stash
            self._stash = None
            return (it if first is END else itertools.chain((first,), it)), serial
        serial = self._position.open()
        epoch, step = self.position
        if self._arrays is not None:
            return self._arrays._pass(epoch, step), serial
        it, self._rest = (iter(self.iterable) if self._rest is None else self._rest), None
        for skipped in range(step):
            if next(it, END) is END:
                raise InvalidArgumentError(
                    f"{self.where}: cannot resume pass {epoch} after {step} batches: it ended after "
                    f"{skipped}; the dataset yields fewer batches than when the position was saved"
                )
        return it, serial

    def peek(self) -> Any:
        """The first batch the next :meth:`open` will yield (``END`` if none)."""
        it, serial = self.open()
        first = next(it, END)
        self._stash = (first, it, serial)
        return first

    def took(self, serial: int) -> None:
        self._position.take(serial)

    def ended(self, serial: int) -> None:
        self._position.end(serial)

    def check(self, where: str, epoch: Any, step: Any) -> tuple[int, int]:
        """A valid position for this dataset (a step past a pass's known length is an error)."""
        try:
            length = len(self.iterable)  # type: ignore[arg-type]
        except TypeError:
            length = None
        return check_position(where, epoch, step, length)

    def reposition(self, epoch: int, step: int) -> None:
        """The next pass opens at ``epoch``, after ``step`` batches (a peeked pass is dropped; a one-shot
        iterator keeps what it has left, the peeked batch too, and skips ``step`` batches of it)."""
        if self._stash is not None:
            first, it, _ = self._stash
            self._stash = None
            if isinstance(self.iterable, Iterator):
                self._rest = it if first is END else itertools.chain((first,), it)
        self._position.set(epoch, step)


def wrap_user_error(exc: Exception, where: str) -> MpistratError:
    """An error every rank can raise for an exception the user's dataset raised on one rank."""
    if isinstance(exc, MpistratError):
        return exc
    return InvalidArgumentError(f"{where}: the dataset raised {type(exc).__name__}: {exc}")
