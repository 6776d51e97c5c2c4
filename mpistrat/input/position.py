"""Where a dataset stands: the pass (epoch) and the batches taken in it, saved by ``Checkpoint``.

A :class:`Position` is shared by a dataset and the iterators over it. A pass that
ends moves it to the next pass; a pass left early (a ``break``) counts as in
progress until the next pass opens, which then starts at the following epoch.

>>> p = Position()
>>> serial = p.open()
>>> p.take(serial); p.take(serial); (p.epoch, p.step)
(0, 2)
>>> p.end(serial); (p.epoch, p.step)
(1, 0)
>>> p.set(4, 3); _ = p.open(); (p.epoch, p.step)
(4, 3)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat.errors import CollectiveMismatchError, InvalidArgumentError
from mpistrat.options import CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives
    from mpistrat.input.source import Source

__all__ = ["InputPosition", "Position", "check_position"]

# Restoring agrees on errors even with the check off: a rank left at another position would read other data.
_ALWAYS = CommunicationOptions(check=True)


class Position:
    """Pass ``epoch`` and the ``step`` batches taken in it; ``running`` once that pass has opened.

    Every :meth:`open` and :meth:`set` starts a new serial; :meth:`take` and :meth:`end`
    count only for the current one, so an iterator of an abandoned pass moves nothing.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.step = 0
        self.running = False
        self.serial = 0

    def open(self) -> int:
        """Open a pass: the pending one, or the next if the current one already opened. Its serial."""
        if self.running:
            self.epoch, self.step = self.epoch + 1, 0
        self.running = True
        self.serial += 1
        return self.serial

    def take(self, serial: int) -> None:
        """One more batch of pass ``serial`` was handed out."""
        if serial == self.serial:
            self.step += 1

    def end(self, serial: int) -> None:
        """Pass ``serial`` ended: the next pass is the following epoch, from its start."""
        if serial == self.serial and self.running:
            self.epoch, self.step, self.running = self.epoch + 1, 0, False

    def set(self, epoch: int, step: int) -> None:
        """The next pass to open is ``epoch``, after its first ``step`` batches."""
        self.epoch, self.step, self.running = epoch, step, False
        self.serial += 1


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

    ``experimental_distribute_dataset``: ``[epoch, step]`` in global batches, the same
    on every rank, so it restores at any number of ranks. ``distribute_datasets_from_function``:
    one ``[epoch, step]`` row per rank (each pipeline counts its own batches), restored
    only at the same number of ranks. ``restart`` (an iterator's) makes the next read
    open the restored pass. ``owner`` is whoever made the dataset (a checkpoint asks it
    whose ranks take part); nothing here uses it.
    """

    dtype = np.dtype(np.int64)

    def __init__(
        self,
        what: str,
        collectives: Collectives,
        source: Source,
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
            return (
                f"int64{list(self.shape)} (the [epoch, step] of each of the {self.shape[0]} ranks' pipelines)"
            )
        return "int64[2] ([epoch, step] in global batches)"

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
        table = self.collectives.agree(f"checkpoint.save ({self.what})", extras=list(self.source.position))
        if self.per_rank:
            return table
        if (table != table[0]).any():
            found = ", ".join(f"rank {r}: {row.tolist()}" for r, row in enumerate(table))
            raise CollectiveMismatchError(
                f"Checkpoint.save: the ranks are at different positions of {self.what} ([epoch, step]: "
                f"{found}); every rank must iterate it the same way"
            )
        return table[0].copy()

    def assign(self, value: Any) -> InputPosition:
        """Restore a saved position (collective: an error on any rank is raised on every rank)."""
        collectives = self.collectives
        row = np.asarray(value)[collectives.rank] if self.per_rank else np.asarray(value)
        epoch, step, error = 0, 0, None
        try:
            epoch, step = self.source.check(f"Checkpoint.restore ({self.what})", row[0].item(), row[1].item())
        except InvalidArgumentError as exc:
            error = exc
        collectives.agree(f"checkpoint.restore ({self.what})", error=error, options=_ALWAYS)
        self.source.reposition(epoch, step)  # reached only when every rank's position was valid
        if self.restart is not None:
            self.restart()
        return self
