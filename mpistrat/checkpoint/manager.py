"""``CheckpointManager``: numbered checkpoints in one directory, keeping the newest few, as tf's.

>>> import mpistrat, numpy as np, os, tempfile
>>> step = mpistrat.Variable(np.int64(0))
>>> manager = CheckpointManager(mpistrat.Checkpoint(step=step), tempfile.mkdtemp(), max_to_keep=2)
>>> paths = [manager.save() for _ in range(3)]
>>> [os.path.basename(p) for p in manager.checkpoints], manager.latest_checkpoint == paths[-1]
(['ckpt-2', 'ckpt-3'], True)
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat.checkpoint import background
from mpistrat.checkpoint.checkpoint import Checkpoint
from mpistrat.checkpoint.files import Listing, checkpoint_state
from mpistrat.errors import InvalidArgumentError
from mpistrat.log import logger
from mpistrat.options import CheckpointOptions
from mpistrat.training.variables import Variable

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["CheckpointManager"]

WINDOW_END = "checkpoint at an accumulation window's end"  # its work in Collectives.after_step and .pending


class CheckpointManager:
    """Save ``checkpoint`` as ``<directory>/<checkpoint_name>-<n>``, keeping the ``max_to_keep`` newest.

    Creating one is collective: rank 0 reads the directory's index, so a restarted job
    finds the checkpoints an earlier one saved (``latest_checkpoint``, ``checkpoints``) and
    keeps deleting the oldest. The numbers come from ``checkpoint.save_counter``, which
    ``checkpoint.restore(manager.latest_checkpoint)`` restores: restore first, and the
    numbering continues where the earlier job stopped.

    Every rank writes its share of one file in rank 0's ``directory``. Another rank may pass
    another directory (tf's multi-worker tutorial gives each non-chief worker a temporary one,
    which it deletes after each save): its calls are accepted, ``save()`` creates that directory
    but writes nothing there, and its paths (``save()``'s result, ``latest_checkpoint``,
    ``checkpoints``) are rank 0's.

    Args:
        checkpoint: the :class:`Checkpoint` to save.
        directory: where the files and the ``checkpoint`` index go (rank 0's counts).
        max_to_keep: how many checkpoints to keep (the oldest are deleted); None keeps all.
        checkpoint_name: the files' prefix.
        save_at_window_end: with gradient accumulation, a ``save()`` called part-way through a
            window (after an ``apply_gradients`` call that only accumulated) waits for the window's
            last call: it is made at the end of the first ``strategy.run`` step after which every
            tracked optimizer is between windows, so the file holds no rank's accumulated gradients
            and restores at any rank count (a file saved mid-window restores only at the rank
            count it was saved at). ``save()`` returns the path it will have; ``sync()`` (and the
            strategy's finalize) makes a save still waiting at once. A
            :class:`~mpistrat.checkpoint.preemption.PreemptionCheckpointHandler` over this
            manager stops at a window's end too.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str],
        max_to_keep: int | None,
        checkpoint_name: str = "ckpt",
        *,
        save_at_window_end: bool = False,
    ):
        if not isinstance(checkpoint, Checkpoint):
            raise InvalidArgumentError(
                "CheckpointManager: checkpoint must be an mpistrat.Checkpoint; "
                f"got {type(checkpoint).__name__}"
            )
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, (int, np.integer)) or max_to_keep < 1
        ):
            raise InvalidArgumentError(
                f"Expected a positive integer or `None` for `max_to_keep`, got {max_to_keep!r}."
            )
        if not isinstance(save_at_window_end, bool):
            raise InvalidArgumentError(
                f"CheckpointManager: save_at_window_end must be True or False; got {save_at_window_end!r}"
            )
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._max_to_keep = max_to_keep
        self.save_at_window_end = save_at_window_end
        self._waiting: tuple[int, CheckpointOptions | None] | None = None  # a save for a window's end
        collectives = checkpoint.strategy("CheckpointManager").extended.collectives
        background.wait_for_saves(collectives)
        collectives.agree("checkpoint.manager")
        prefix = os.path.join(self._directory, checkpoint_name)

        def read() -> tuple[str, str | None, list[str]]:  # on rank 0: its prefix and its index
            return (prefix, *checkpoint_state(self._directory))

        self._prefix, self._latest, self._checkpoints = collectives.on_root(
            read, kind="checkpoint.manager (read)"
        )

    checkpoint = property(lambda self: self._checkpoint, doc="The managed Checkpoint.")
    directory = property(lambda self: self._directory, doc="Where the checkpoints are written.")

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint's path, or None before the first save (here or in an earlier job)."""
        return self._latest

    @property
    def checkpoints(self) -> list[str]:
        """The paths of the checkpoints kept, oldest first."""
        return list(self._checkpoints)

    def save(
        self,
        checkpoint_number: int | Variable | None = None,
        check_interval: bool = True,
        options: CheckpointOptions | None = None,
    ) -> str:
        """Write a new checkpoint (collective), delete the oldest beyond ``max_to_keep``; returns its path.

        It is numbered ``checkpoint_number`` if given (e.g. the training step), else by
        ``save_counter``, which is incremented either way. Saving a number that is already kept
        replaces that file and makes it the newest. With ``CheckpointOptions(enable_async=True)``
        it returns once this rank's share is copied aside: ``latest_checkpoint``, the index and
        the deletions follow when the file is in place (the next checkpoint call, ``sync()`` or
        the end of the job). ``check_interval`` is tf's and has no effect (no interval is set).
        """
        collectives = self._checkpoint.strategy("save").extended.collectives
        background.wait_for_saves(collectives)
        counter = int(self._checkpoint.save_counter.numpy()) + 1
        number = counter if checkpoint_number is None else _integer(checkpoint_number)
        if self.save_at_window_end and (windows := self._checkpoint.accumulating()):
            return self._wait_for_window_end(collectives, number, options, windows)
        self._waiting = None  # a save waiting for a window's end is overtaken by this one
        return self._save_now(collectives, number, options)

    def _save_now(self, collectives: Collectives, number: int, options: CheckpointOptions | None) -> str:
        """Write ``<prefix>-<number>`` (collective): :meth:`save`'s work."""
        path = f"{self._prefix}-{number}"
        kept = [p for p in self._checkpoints if p != path] + [path]
        dropped = kept[: -self._max_to_keep] if self._max_to_keep else []
        kept = kept[len(dropped) :]

        def in_place() -> None:  # every rank, once the file is in place
            self._latest, self._checkpoints = path, kept

        self._checkpoint.save_as(path, options, Listing(self._directory, kept, dropped), in_place)
        if collectives.rank != 0 and os.path.dirname(self._prefix) != self._directory:
            os.makedirs(self._directory, exist_ok=True)  # as tf's save creates it (left empty here)
        return path

    def sync(self) -> None:
        """Wait for a background save to be written and in place (collective), as tf's; a save waiting
        for the end of an accumulation window (``save_at_window_end``) is made now."""
        self._save_waiting(self._checkpoint.strategy("sync").extended.collectives)
        self._checkpoint.sync()

    def _wait_for_window_end(
        self, collectives: Collectives, number: int, options: CheckpointOptions | None, windows: list[str]
    ) -> str:
        """Keep a save for the end of the first step after which no tracked optimizer is mid-window."""
        path = f"{self._prefix}-{number}"
        if self._waiting is None:
            said = "CheckpointManager.save: %s waits for the accumulation window's end (optimizer %s)"
            logger.info(said, path, ", ".join(windows))
        self._waiting = (number, options)
        collectives.after_step[WINDOW_END] = functools.partial(self._at_step_end, collectives)
        collectives.pending[WINDOW_END] = functools.partial(self._save_waiting, collectives)
        return path

    def _at_step_end(self, collectives: Collectives) -> None:
        if not self._checkpoint.accumulating():  # on every rank alike
            self._save_waiting(collectives)

    def _save_waiting(self, collectives: Collectives) -> None:
        """The save kept for a window's end, now (collective)."""
        collectives.after_step.pop(WINDOW_END, None)
        collectives.pending.pop(WINDOW_END, None)
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            number, options = waiting
            self._save_now(collectives, number, options)


def _integer(number: Any) -> int:
    value = number.numpy() if isinstance(number, Variable) else number
    if isinstance(value, bool) or not np.issubdtype(np.asarray(value).dtype, np.integer) or np.ndim(value):
        raise InvalidArgumentError(
            "CheckpointManager.save: checkpoint_number must be an integer (or an integer variable); "
            f"got {number!r}"
        )
    return int(value)
