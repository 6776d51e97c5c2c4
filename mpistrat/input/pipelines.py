"""The iterator of ``distribute_datasets_from_function``: one pipeline per rank, lengths may differ.

Every step costs one handshake (kind ``dataset_end``) whose extras carry each rank's
batch size (``-1``: exhausted), so every rank learns the same thing at the same time
and takes the same decision: go on (exhausted replicas get an empty batch, or for a
pipeline of unbatched elements tf's dummy element: zeros, a scalar ``0`` for a scalar),
end the epoch, or raise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat.collectives import check_enabled
from mpistrat.errors import CollectiveMismatchError, InvalidArgumentError, MpistratError
from mpistrat.input.batches import Batch, agree_specs, empty_batch, examine, spec_fingerprint
from mpistrat.input.batches import fingerprint as batch_fingerprint
from mpistrat.input.contexts import InputOptions, require_spmd
from mpistrat.input.iterators import DistributedIterator, describe_step
from mpistrat.input.source import END, UNKNOWN, Source, wrap_user_error
from mpistrat.options import CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["PipelineIterator", "SpecCell", "agree_element_spec"]

# A step's handshake runs even with the check off: it says whether any pipeline ran out.
_HANDSHAKE = CommunicationOptions(check=True)


class SpecCell:
    """The element spec agreed at the first step, shared by a dataset and its iterators."""

    def __init__(self) -> None:
        self.value: Any = UNKNOWN


def agree_element_spec(collectives: Collectives, batch: Any, error: MpistratError | None, where: str) -> Any:
    """Collective: the element spec every pipeline agrees on (None when every pipeline is empty).

    Raises on every rank if any rank failed or the pipelines yield different structures or dtypes.
    A rank that has a batch keeps its own inner shapes; an empty pipeline takes the first rank's.
    """
    collectives.agree("element_spec", error=error)
    local = batch.spec if isinstance(batch, Batch) else None
    agreed = agree_specs(collectives.comm.allgather(local), where)
    return agreed if local is None else local


class PipelineIterator(DistributedIterator):
    """Each rank reads its own pipeline; the ranks agree at every step on who still has data."""

    where = "distribute_datasets_from_function"
    pipelines = True

    def __init__(
        self,
        collectives: Collectives,
        source: Source,
        options: InputOptions,
        spec: SpecCell,
        where: str = "distribute_datasets_from_function",
        owner: object = None,
    ):
        super().__init__(collectives, options, owner)
        self.where = where  # make_input_fn_iterator's errors name it
        self._source = source
        self._cell = spec
        self._restart()

    def _restart(self) -> None:
        super()._restart()
        self._exhausted = False
        self._batches = 0
        self._examples = 0

    def _pull(self) -> tuple[Any, MpistratError | None, BaseException | None]:
        """The next local batch (or ``END``), with the error and its cause if reading failed."""
        if self._pending is not UNKNOWN:
            pending, self._pending = self._pending, UNKNOWN
            return pending
        if self._exhausted:
            return END, None, None
        try:
            if self._it is None:
                self._it, self._serial = self._source.open()
            raw = next(self._it, END)
            self._exhausted = raw is END
            return (raw if raw is END else examine(raw, self.where, unbatched=True)), None, None
        except Exception as exc:
            return END, wrap_user_error(exc, self.where), (None if isinstance(exc, MpistratError) else exc)

    @property
    def element_spec(self) -> Any:
        """The spec the pipelines agreed on at the first step.

        Before the first step (no communication): this rank's first batch's spec,
        None if this rank's pipeline is empty.
        """
        if self._cell.value is not UNKNOWN:
            return self._cell.value
        if self._pending is UNKNOWN:
            self._pending = self._pull()
        batch, error, cause = self._pending
        if error is not None:
            raise error from cause
        return batch.spec if isinstance(batch, Batch) else None

    def _step(self) -> Any:
        if self._done:
            return END
        require_spmd("get_next")
        collectives = self._collectives
        collectives.require_open()
        batch, error, cause = self._pull()
        have = isinstance(batch, Batch)
        spec = self._cell.value
        if spec is UNKNOWN:
            try:
                spec = agree_element_spec(collectives, batch, error, self.where)
            except MpistratError as exc:
                self._finish(exc, cause)
            # None: every pipeline is empty at this step (a pass resumed at its end); ask again next time.
            if spec is not None:
                self._cell.value = spec
        try:
            fingerprint = 0
            if check_enabled(collectives) and spec is not None:
                fingerprint = (
                    batch_fingerprint(
                        batch.treespec, batch.leaves, memo=collectives.caches.codes, batched=batch.batched
                    )
                    if have
                    else spec_fingerprint(spec, collectives.caches.codes)
                )
            # Whether any pipeline ran out rides in the handshake (its MAXIMUM slot, so a step costs
            # no more bytes at more ranks); the per-rank counts travel only then, once per epoch.
            ended = collectives.agree(
                "dataset_end",
                fingerprint=fingerprint,
                describe=lambda: describe_step(batch, spec),
                error=error,
                maximum=int(not have),
                options=None if check_enabled(collectives) else _HANDSHAKE,
            )
            table = None
            if ended:
                counts = [
                    batch.size if have else -1,
                    self._batches + have,
                    self._examples + (batch.size if have else 0),
                ]
                table = collectives.agree("dataset_end (counts)", extras=counts)
        except CollectiveMismatchError as exc:
            self._finish(
                CollectiveMismatchError(
                    f"{self.where}: the ranks disagree at step {self._steps + 1} (every pipeline must yield "
                    "the same nest structure and dtypes, and every rank must step its iterator together). "
                    f"{exc}"
                ),
                cause,
            )
        except MpistratError as exc:
            self._finish(exc, cause)
        self._steps += 1
        exhausted = [False] if table is None else [int(n) < 0 for n in table[:, 0]]
        if all(exhausted) or (any(exhausted) and self._options.uneven == "drop"):
            self._done = True
            self._source.ended(self._serial)
            return END
        if table is not None and any(exhausted) and self._options.uneven == "error":
            self._done = True
            raise InvalidArgumentError(self._uneven_message(table))
        if not have:
            return empty_batch(spec)
        self._batches += 1
        self._examples += batch.size
        self._source.took(self._serial, batch.size)
        return batch.value

    def _uneven_message(self, table: np.ndarray) -> str:
        ended = [r for r in range(len(table)) if table[r, 0] < 0]
        going = [r for r in range(len(table)) if table[r, 0] >= 0]
        counts = ", ".join(f"rank {r}: {table[r, 1]} ({table[r, 2]})" for r in range(len(table)))
        return (
            f"{self.where}: the input pipelines have different lengths and InputOptions(uneven='error') was "
            f"given: ranks {ended} ran out of data at step {self._steps} while ranks {going} still had some. "
            f"Batches (examples) read so far: {counts}. Make every pipeline yield the same number of "
            "batches, or use uneven='pad' (exhausted replicas get empty batches) or 'drop' (the epoch ends "
            "with the shortest pipeline)"
        )
