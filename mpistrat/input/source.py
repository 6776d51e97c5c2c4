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
from mpistrat.input import saved_row
from mpistrat.input.arrays import ArrayDataset
from mpistrat.input.batches import examine
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
        """``(epoch, step)``: the pass in progress (or the next) and the batches taken in it (a restored
        pass: counted in the batches it has now)."""
        return self._position.epoch, self._position.step

    def open(self) -> tuple[Iterator[Any], int]:
        """A pass's iterator, and the serial that :meth:`took` and :meth:`ended` count it by."""
        if self._stash is not None:
            first, it, serial = self._stash
            self._stash = None
            return (it if first is END else itertools.chain((first,), it)), serial
        serial = self._position.open()
        if self._arrays is not None:
            return self._arrays._opened_pass(), serial
        it, self._rest = (iter(self.iterable) if self._rest is None else self._rest), None
        self._skip(it)
        return it, serial

    def _skip(self, it: Iterator[Any]) -> None:
        """Read and drop what the opened pass resumes after: ``step`` batches, or (a restore) the
        batches holding ``examples`` examples, which must end on a batch boundary."""
        position = self._position
        epoch, by_examples = position.epoch, position.by_examples
        wanted = (position.examples or 0) if by_examples else position.step
        said = f"{wanted} examples" if by_examples else f"{wanted} batches"
        batches = examples = 0
        while (examples if by_examples else batches) < wanted:
            raw = next(it, END)
            if raw is END:
                raise InvalidArgumentError(
                    f"{self.where}: cannot resume pass {epoch} after {said}: it ended after {batches} "
                    f"batches ({examples} examples); the dataset yields fewer than when the position was "
                    "saved"
                )
            size = examine(raw, self.where, unbatched=True).size
            if by_examples and examples + size > wanted:
                raise InvalidArgumentError(
                    f"{self.where}: cannot resume pass {epoch} after {said}: that falls inside a batch "
                    f"(examples {examples} to {examples + size}); the dataset is batched differently from "
                    "when the position was saved. Resume with the batch size it was saved with, or use an "
                    "ArrayDataset, which resumes at any example"
                )
            batches, examples = batches + 1, examples + size
        position.skipped(batches, examples)

    def peek(self) -> Any:
        """The first batch the next :meth:`open` will yield (``END`` if none)."""
        it, serial = self.open()
        first = next(it, END)
        self._stash = (first, it, serial)
        return first

    def took(self, serial: int, examples: int) -> None:
        self._position.take(serial, examples)

    def untook(self, serial: int, examples: int) -> None:
        """A batch of pass ``serial`` taken back: it is read again (after a rank's death)."""
        self._position.untake(serial, examples)

    def ended(self, serial: int) -> None:
        self._position.end(serial)

    @property
    def identity(self) -> saved_row.Identity:
        """What a checkpoint records of the dataset: an ArrayDataset's order and length; nothing of
        another iterable (its order is its own, its examples are counted only as they are read)."""
        return saved_row.Identity() if self._arrays is None else self._arrays.identity

    def checkpoint_row(self) -> list[int]:
        """This position as a checkpoint row; in the earlier layout while the examples taken are not
        known (a pass set by batches and not opened since)."""
        position = self._position
        if position.examples is None:
            return [position.epoch, position.step]
        return saved_row.encode(position.epoch, position.examples, self.identity)

    def progress(self) -> tuple[int, int | None]:
        """The batches taken in the pass in progress, and the seed it is shuffled with (None: an
        ArrayDataset that does not shuffle, or another iterable, whose order is its own)."""
        arrays = self._arrays
        return self._position.step, arrays.seed if arrays is not None and arrays.shuffle else None

    def check_saved(self, where: str, saved: saved_row.Saved) -> saved_row.Saved:
        """``saved``, checked against this dataset: a valid position, of this dataset (its order and
        number of examples as when it was saved), within a pass."""
        if saved.examples is None:  # the earlier layout: batches
            epoch, step = check_position(where, saved.epoch, saved.batches, self._length())
            return saved_row.Saved(epoch, step, None, None)
        epoch, examples = check_position(where, saved.epoch, saved.examples, None)
        now = self.identity
        changed = now.differences(saved.identity or saved_row.Identity())
        if changed:
            raise InvalidArgumentError(
                f"{where}: the dataset is not the one whose position was saved: {' and '.join(changed)} "
                f"{'differ' if len(changed) > 1 else 'differs'} (now: {self.iterable!r}). Resuming pass "
                f"{epoch} after {examples} examples would visit some examples twice and others never. Make "
                "the dataset as it was when saved, or "
                "restore without it (leave it out of the Checkpoint) to start its passes afresh"
            )
        if self._arrays is not None and examples > self._arrays.num_examples:
            raise InvalidArgumentError(
                f"{where}: pass {epoch} after {examples} examples is past the end of a pass of "
                f"{self._arrays.num_examples} examples"
            )
        return saved_row.Saved(epoch, None, examples, now)

    def _length(self) -> int | None:
        try:
            return len(self.iterable)  # type: ignore[arg-type]
        except TypeError:
            return None

    def reposition(self, saved: saved_row.Saved) -> None:
        """The next pass opens at ``saved``'s epoch, after its batches or examples (a peeked pass is
        dropped; a one-shot iterator keeps what it has left, the peeked batch too, and skips from it)."""
        if self._stash is not None:
            first, it, _ = self._stash
            self._stash = None
            if isinstance(self.iterable, Iterator):
                self._rest = it if first is END else itertools.chain((first,), it)
        if saved.examples is None:
            step = saved.batches or 0
            examples = None
            if self._arrays is not None:  # an ArrayDataset knows the examples of its batches
                examples = min(step * self._arrays.batch_size, self._arrays.num_examples)
            self._position.set(saved.epoch, step, examples)
        else:
            self._position.set(saved.epoch, 0, saved.examples)


def wrap_user_error(exc: Exception, where: str) -> MpistratError:
    """An error every rank can raise for an exception the user's dataset raised on one rank."""
    if isinstance(exc, MpistratError):
        return exc
    return InvalidArgumentError(f"{where}: the dataset raised {type(exc).__name__}: {exc}")
