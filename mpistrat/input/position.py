"""Where a dataset stands: the pass (epoch) and what was taken of it, saved by ``Checkpoint``.

A :class:`Position` is shared by a dataset and the iterators over it. A pass that
ends moves it to the next pass; a pass left early (a ``break``) counts as in
progress until the next pass opens, which then starts at the following epoch. It counts
batches and examples: a restore resumes at the example where the save stood (the batches
may be of another size now), and the checkpoint row says which dataset it was
(:mod:`mpistrat.input.saved_row`).

>>> p = Position()
>>> serial = p.open()
>>> p.take(serial, 8); p.take(serial, 8); (p.epoch, p.step, p.examples)
(0, 2, 16)
>>> p.end(serial); (p.epoch, p.step, p.examples)
(1, 0, 0)
>>> p.set(4, 3); _ = p.open(); (p.epoch, p.step, p.examples)
(4, 3, None)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from mpistrat.errors import CollectiveMismatchError, InvalidArgumentError
from mpistrat.input import saved_row
from mpistrat.interface.saved_entry import POSITION
from mpistrat.options import CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["InputPosition", "Position", "Resumable", "check_position"]


class Resumable(Protocol):
    """What a checkpoint entry asks of the input it saves (``input/source.py``'s ``Source``)."""

    def checkpoint_row(self) -> list[int]: ...

    def progress(self) -> tuple[int, int | None]: ...

    def check_saved(self, where: str, saved: saved_row.Saved) -> saved_row.Saved: ...

    def reposition(self, saved: saved_row.Saved) -> None: ...


# Restoring agrees on errors even with the check off: a rank left at another position would read other data.
_ALWAYS = CommunicationOptions(check=True)


class Position:
    """Pass ``epoch``, the ``step`` batches and ``examples`` examples taken in it; ``running`` once
    that pass has opened.

    ``examples`` is None while not known: a pass set to resume after ``step`` batches of an
    iterable whose batches were not read yet. ``by_examples``: the next pass resumes after
    ``examples`` examples (a restore), else after ``step`` batches. Every :meth:`open` and
    :meth:`set` starts a new serial; :meth:`take` and :meth:`end` count only for the current
    one, so an iterator of an abandoned pass moves nothing.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.step = 0
        self.examples: int | None = 0
        self.by_examples = False
        self.running = False
        self.serial = 0

    def open(self) -> int:
        """Open a pass: the pending one, or the next if the current one already opened. Its serial."""
        if self.running:
            self._start(self.epoch + 1)
        self.running = True
        self.serial += 1
        return self.serial

    def _start(self, epoch: int) -> None:
        self.epoch, self.step, self.examples, self.by_examples = epoch, 0, 0, False

    def take(self, serial: int, examples: int) -> None:
        """One more batch of pass ``serial``, of ``examples`` examples, was handed out."""
        if serial == self.serial:
            self.step += 1
            if self.examples is not None:
                self.examples += examples

    def untake(self, serial: int, examples: int) -> None:
        """The last batch of pass ``serial``, of ``examples`` examples, was given back (to be read again)."""
        if serial == self.serial:
            self.step -= 1
            if self.examples is not None:
                self.examples -= examples

    def end(self, serial: int) -> None:
        """Pass ``serial`` ended: the next pass is the following epoch, from its start."""
        if serial == self.serial and self.running:
            self._start(self.epoch + 1)
            self.running = False

    def set(self, epoch: int, step: int, examples: int | None = None) -> None:
        """The next pass to open is ``epoch``, after its first ``step`` batches, or after its first
        ``examples`` examples when they are given."""
        self.epoch, self.step, self.running = epoch, step, False
        self.examples, self.by_examples = examples, examples is not None
        self.serial += 1

    def skipped(self, batches: int, examples: int) -> None:
        """The pass just opened starts after ``batches`` batches of ``examples`` examples."""
        self.step, self.examples, self.by_examples = batches, examples, False


def check_position(where: str, epoch: Any, step: Any, length: int | None) -> tuple[int, int]:
    """``(epoch, step)`` as ints, or ``InvalidArgumentError`` saying what was expected and what came.

    >>> check_position("set_epoch", 2, 5, 4)
    Traceback (most recent call last):
    ...
    mpistrat.errors.InvalidArgumentError: set_epoch: step 5 is past the end of a pass of 4 batches; ...
    """
    for name, value in (("epoch", epoch), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise InvalidArgumentError(f"{where}: {name} must be an int >= 0; got {value!r}")
    if length is not None and step > length:
        raise InvalidArgumentError(
            f"{where}: step {step} is past the end of a pass of {length} batches; expected a step in "
            f"[0, {length}] (the batches already taken in pass {epoch})"
        )
    return int(epoch), int(step)


class InputPosition:
    """A distributed dataset's or iterator's position as a :class:`~mpistrat.Checkpoint` entry.

    ``experimental_distribute_dataset``: one row (:mod:`~mpistrat.input.saved_row`: the pass,
    the examples of the global batches taken, which dataset), the same on every rank, so it
    restores at any number of ranks and any global batch size. ``distribute_datasets_from_function``:
    one row per rank (each pipeline counts its own examples), restored only at the same number
    of ranks. ``restart`` (an iterator's) makes the next read
    open the restored pass. ``owner`` is whoever made the dataset (a checkpoint asks it
    whose ranks take part); nothing here uses it.
    """

    holding: Literal["position"] = POSITION  # a checkpoint entry (interface/saved_entry.py)
    dtype = np.dtype(np.int64)

    def __init__(
        self,
        what: str,
        collectives: Collectives,
        source: Resumable,
        per_rank: bool,
        restart: Callable[[], None] | None = None,
        owner: object = None,
    ):
        self.what = what
        self.collectives = collectives
        self.source = source
        self.per_rank = per_rank
        self.restart = restart
        self.owner = owner

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.collectives.size, 2) if self.per_rank else (2,)

    def _expected(self) -> str:
        if self.per_rank:
            return f"int64{list(self.shape)} (the position of each of the {self.shape[0]} ranks' pipelines)"
        return "int64[2] (the pass, and the examples taken in it)"

    def mismatch(self, dtype: np.dtype, shape: tuple[int, ...]) -> str | None:
        """What is wrong with a checkpoint entry of ``dtype`` and ``shape`` for this position, if anything."""
        if dtype == self.dtype and tuple(shape) == self.shape:
            return None
        held = f"{dtype}{list(shape)}"
        if self.per_rank and dtype == self.dtype and len(shape) == 2 and shape[1] == 2:
            return (
                f"the position of {self.what}'s pipelines was saved at {shape[0]} ranks and this job has "
                f"{self.shape[0]}: each rank's pipeline is its own, so its position restores only at the "
                f"same number of ranks (experimental_distribute_dataset counts global batches and restores "
                f"at any number); expected {self._expected()}, the checkpoint holds {held}"
            )
        return f"the position of {self.what}: expected {self._expected()}, the checkpoint holds {held}"

    def value(self) -> np.ndarray:
        """The position to save (collective: every rank's, gathered; for split input they must agree)."""
        return self.saved()[0]

    def saved(self) -> tuple[np.ndarray, dict[str, int | None] | None]:
        """The position to save, and for split input the same in words: the epoch, the batches and
        examples taken in it, the shuffling seed (None where the dataset has none). Collective:
        every rank's, gathered; for split input they must agree, the batches and seed too."""
        batches, seed = self.source.progress()
        known = seed if seed is not None and 0 <= seed < 2**63 else -1  # an int64 of the agreement
        table = self.collectives.agree(
            f"checkpoint.save ({self.what})", extras=[*self.source.checkpoint_row(), batches, known]
        )
        if self.per_rank:
            return table[:, :2].copy(), None
        if (table != table[0]).any():
            found = ", ".join(
                f"rank {r}: {_describe(row[:2])}, {row[2]} batches" for r, row in enumerate(table)
            )
            raise CollectiveMismatchError(
                f"Checkpoint.save: the ranks are at different positions of {self.what} ({found}); every "
                "rank must iterate it the same way"
            )
        row = saved_row.decode(table[0, :2])
        words = {
            "epoch": row.epoch,
            "batches": batches,
            "examples": row.examples,
            "seed": None if known < 0 else known,
        }
        return table[0, :2].copy(), words

    def assign(self, value: Any) -> InputPosition:
        """Restore a saved position (collective: an error on any rank is raised on every rank)."""
        self.apply(self.check(value))
        return self

    def check(self, value: Any) -> Any:
        """A saved position checked against this dataset (collective: an error on any rank is raised
        on every rank), for :meth:`apply`: a checkpoint checks every position before it assigns
        anything."""
        collectives = self.collectives
        row = np.asarray(value)[collectives.rank] if self.per_rank else np.asarray(value)
        saved, error = saved_row.decode(row), None
        try:
            saved = self.source.check_saved(f"Checkpoint.restore ({self.what})", saved)
        except InvalidArgumentError as exc:
            error = exc
        collectives.agree(f"checkpoint.restore ({self.what})", error=error, options=_ALWAYS)
        return saved

    def apply(self, saved: Any) -> None:
        """Move to a position :meth:`check` accepted (on this rank; nothing is sent)."""
        self.source.reposition(saved)
        if self.restart is not None:
            self.restart()


def _describe(row: Any) -> str:
    saved = saved_row.decode(row)
    if saved.examples is None:
        return f"pass {saved.epoch} after {saved.batches} batches"
    identity = saved.identity or saved_row.Identity()
    digests = f"dataset digests {identity.order}, {identity.length}"
    return f"pass {saved.epoch} after {saved.examples} examples ({digests})"
