"""Iterators over distributed input, and how the ranks agree at every step.

``SplitIterator`` (``experimental_distribute_dataset``): every rank reads the same
global batch and keeps its own part, so the ranks need not talk; while checking is
on, one small handshake per step (kind ``dataset_step``) makes sure they really did
read the same batches, so a dataset that differs between ranks raises everywhere
instead of deadlocking a later collective.

``PipelineIterator`` (``distribute_datasets_from_function``): each rank reads its
own pipeline, and the lengths may differ. Every step costs one handshake (kind
``dataset_end``) whose extras carry each rank's batch size (``-1``: exhausted), so
every rank learns the same thing at the same time and takes the same decision:
go on (exhausted replicas get an empty batch, or for a pipeline of unbatched
elements tf's dummy element: zeros, a scalar ``0`` for a scalar), end the epoch, or raise.

Neither may be stepped inside ``strategy.run``: ``next(iterator)`` there raises, as tf's.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat import context, nest
from mpistrat.collectives import check_enabled
from mpistrat.collectives.mismatch import checksum, hash64
from mpistrat.errors import CollectiveMismatchError, InvalidArgumentError, MpistratError
from mpistrat.input.arrays import ArrayDataset
from mpistrat.input.batches import (
    Batch,
    Rows,
    agree_specs,
    empty_batch,
    examine,
    replica_range,
    spec_fingerprint,
    split_batch,
)
from mpistrat.input.batches import (
    fingerprint as batch_fingerprint,
)
from mpistrat.input.contexts import InputOptions, require_spmd
from mpistrat.input.position import Position, check_position
from mpistrat.options import CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.distribute.strategy import Strategy

__all__ = [
    "DistributedIterator",
    "Optional",
    "PipelineIterator",
    "Source",
    "SpecCell",
    "SplitIterator",
    "agree_element_spec",
    "refuse_in_replica_fn",
]

END: Any = type("End", (), {"__repr__": lambda self: "<end of data>"})()
_UNKNOWN: Any = type("Unknown", (), {"__repr__": lambda self: "<unknown>"})()
_END_CODE = hash64("end of data")
# A step's handshake runs even with the check off: it says whether any pipeline ran out.
_HANDSHAKE = CommunicationOptions(check=True)
_CODE_BITS = (1 << 62) - 1  # what a handshake slot holds with room for its negation


class Source:
    """The user's iterable of batches and its :class:`Position`; peeking at the first batch does not lose it.

    A peek opens a pass and keeps it (with the batch it read) for the next
    :meth:`open`, so a one-shot generator, or a dataset whose every pass differs
    (a reshuffle per epoch), is read exactly as if nobody had peeked. An
    :class:`~mpistrat.ArrayDataset` shares its own position, and a pass opened at
    a step skips there by index arithmetic, gathering checked :class:`Batch` objects;
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


def refuse_in_replica_fn() -> None:
    """tf's check in ``get_next``: reading the next element inside ``strategy.run`` is an error.

    Local (every rank runs the same ``replica_fn``, so every rank raises); the default
    strategy's replica context, outside any scope, is not inside ``run``.
    """
    mode = context.current_mode()
    if mode.replica_context is not None and mode.kind != "default":
        raise InvalidArgumentError(
            "next(iterator) should be called from outside of replica_fn. "
            "e.g. strategy.run(replica_fn, args=(next(iterator),))"
        )


def wrap_user_error(exc: Exception, where: str) -> MpistratError:
    """An error every rank can raise for an exception the user's dataset raised on one rank."""
    if isinstance(exc, MpistratError):
        return exc
    return InvalidArgumentError(f"{where}: the dataset raised {type(exc).__name__}: {exc}")


class Optional:
    """A value that may be absent, as ``tf.experimental.Optional``.

    >>> Optional(3).has_value(), Optional(3).get_value(), Optional().has_value()
    (True, 3, False)
    """

    def __init__(self, value: Any = END, element_spec: Any = None):
        self._value = value
        self._element_spec = element_spec

    def has_value(self) -> bool:
        """Whether there is a value (the same answer on every rank)."""
        return self._value is not END

    def get_value(self) -> Any:
        """The value; raises ``InvalidArgumentError`` when there is none."""
        if self._value is END:
            raise InvalidArgumentError(
                "Optional.get_value: the optional has no value; check has_value() first"
            )
        return self._value

    @property
    def element_spec(self) -> Any:
        return self._element_spec

    def __repr__(self) -> str:
        return f"Optional({self._value!r})" if self.has_value() else "Optional(<no value>)"


class DistributedIterator:
    """An iterator over distributed input: every step gives this replica's batch.

    ``next(it)`` / ``it.get_next()`` raise ``StopIteration`` once the data ends (on
    every rank at the same step); ``get_next_as_optional()`` returns an empty
    :class:`Optional` instead. Every rank must step the iterator together.
    """

    where = "distributed dataset"

    def __init__(self, strategy: Strategy, options: InputOptions):
        self._strategy = strategy
        self._options = options
        self._done = False
        self._steps = 0

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        refuse_in_replica_fn()
        value = self._step()
        if value is END:
            raise StopIteration
        return value

    def get_next(self) -> Any:
        """This replica's next batch; ``StopIteration`` at the end of the data.

        Called outside ``strategy.run``, as tf requires: inside it raises ``InvalidArgumentError``
        (a ``ValueError``, tf's) on every rank that calls it.
        """
        return self.__next__()

    def get_next_as_optional(self) -> Optional:
        """This replica's next batch as an :class:`Optional`, empty at the end of the data."""
        value = self._step()
        return Optional(value, self.element_spec)

    @property
    def element_spec(self) -> Any:
        """The per-replica element: the batch's nest with an ``ArraySpec`` per leaf."""
        raise NotImplementedError

    def _step(self) -> Any:
        raise NotImplementedError

    def _finish(self, exc: MpistratError, cause: BaseException | None) -> None:
        self._done = True
        if cause is not None:
            raise exc from cause
        raise exc


def _rows_code(batch: Batch) -> int:
    """A checksum of the rows a shuffled or sharded ArrayDataset's global batch holds (0 otherwise):
    ranks at different positions of the dataset read batches of the same shapes but other rows."""
    rows = next((a for a in batch.leaves if isinstance(a, Rows)), None)
    return 0 if rows is None else checksum(rows.index) & _CODE_BITS


def _describe(batch: Any, spec: Any = None) -> dict[str, Any]:
    """This rank's step, in the form the handshake compares to explain a mismatch."""
    if isinstance(batch, Batch):
        paths = nest.flatten_with_paths(batch.spec)
        leaves = [
            (nest.path_str(p), str(a.dtype), tuple(a.shape))
            for (p, _), a in zip(paths, batch.leaves, strict=True)
        ]
        if code := _rows_code(batch):
            leaves.append(("the global batch's rows", f"checksum {code:016x}", ()))
        return {"leaves": leaves}
    if spec is not None:
        return {
            "leaves": [
                (nest.path_str(p), str(s.dtype), "exhausted") for p, s in nest.flatten_with_paths(spec)
            ]
        }
    return {"leaves": [("<end of data>", "-", "-")]}


class SplitIterator(DistributedIterator):
    """Each rank reads the same global batch and keeps ``replica_range`` of it."""

    where = "experimental_distribute_dataset"

    def __init__(self, strategy: Strategy, source: Source, options: InputOptions):
        super().__init__(strategy, options)
        self._source = source
        self._spec: Any = _UNKNOWN
        self._restart()

    def _restart(self) -> None:
        """Forget this iterator's pass: the next read opens the source's (restored) position."""
        self._it: Iterator[Any] | None = None
        self._serial = 0
        self._pending: Any = _UNKNOWN
        self._done = False

    def _read(self) -> Any:
        if self._pending is not _UNKNOWN:
            raw, self._pending = self._pending, _UNKNOWN
            return raw
        if self._it is None:
            self._it, self._serial = self._source.open()
        return next(self._it, END)

    @property
    def element_spec(self) -> Any:
        if self._spec is _UNKNOWN:
            self._pending = self._read()
            self._spec = None if self._pending is END else examine(self._pending, self.where).spec
        return self._spec

    def _step(self) -> Any:
        if self._done:
            return END
        require_spmd("get_next")
        collectives = self._strategy.extended.collectives
        batch, error, cause = END, None, None
        try:
            raw = self._read()
            batch = raw if raw is END else examine(raw, self.where)
        except Exception as exc:
            error, cause = wrap_user_error(exc, self.where), (None if isinstance(exc, MpistratError) else exc)
        if check_enabled(collectives):
            fingerprint = _END_CODE
            if isinstance(batch, Batch):
                fingerprint = batch_fingerprint(
                    batch.treespec, batch.leaves, shapes=True, memo=collectives.caches.codes
                ) ^ _rows_code(batch)
            try:
                collectives.agree(
                    "dataset_step", fingerprint=fingerprint, describe=lambda: _describe(batch), error=error
                )
            except CollectiveMismatchError as exc:
                self._finish(
                    CollectiveMismatchError(
                        f"{self.where}: the ranks read different global batches at step {self._steps + 1}. "
                        "Every rank must iterate the same dataset (the same batches in the same order; "
                        "shuffle with a seed shared by all ranks) from the same position: a shuffled "
                        "ArrayDataset reshuffles at every pass, so a pass over it on some ranks only "
                        f"(to look at a sample) moves those ranks to another order. {exc}"
                    ),
                    cause,
                )
            except MpistratError as exc:
                self._finish(exc, cause)
        elif error is not None:
            self._finish(error, cause)
        if batch is END:
            self._done = True
            self._source.ended(self._serial)
            return END
        self._steps += 1
        size, rank = self._strategy.extended.size, self._strategy.extended.rank
        if self._spec is _UNKNOWN:
            self._spec = batch.spec
        counts = [stop - start for start, stop in (replica_range(batch.size, size, r) for r in range(size))]
        if batch.size and 0 in counts and self._options.uneven != "pad":
            self._done = True
            if self._options.uneven == "drop":
                self._source.ended(self._serial)
                return END
            empty = [r for r, n in enumerate(counts) if n == 0]
            raise InvalidArgumentError(
                f"{self.where}: global batch {self._steps} has {batch.size} examples, which leaves "
                f"replicas {empty} of {size} without data (split {counts}) and InputOptions(uneven='error') "
                "was given. Use a global batch size that is a multiple of the number of replicas (and drop "
                "the short last batch when batching), or uneven='pad' (those replicas get empty batches) or "
                "'drop' (the epoch ends there)"
            )
        self._source.took(self._serial)
        return split_batch(batch, size, rank)


class SpecCell:
    """The element spec agreed at the first step, shared by a dataset and its iterators."""

    def __init__(self) -> None:
        self.value: Any = _UNKNOWN


def agree_element_spec(strategy: Strategy, batch: Any, error: MpistratError | None, where: str) -> Any:
    """Collective: the element spec every pipeline agrees on (None when every pipeline is empty).

    Raises on every rank if any rank failed or the pipelines yield different structures or dtypes.
    A rank that has a batch keeps its own inner shapes; an empty pipeline takes the first rank's.
    """
    collectives = strategy.extended.collectives
    collectives.agree("element_spec", error=error)
    local = batch.spec if isinstance(batch, Batch) else None
    agreed = agree_specs(collectives.comm.allgather(local), where)
    return agreed if local is None else local


class PipelineIterator(DistributedIterator):
    """Each rank reads its own pipeline; the ranks agree at every step on who still has data."""

    where = "distribute_datasets_from_function"

    def __init__(
        self,
        strategy: Strategy,
        source: Source,
        options: InputOptions,
        spec: SpecCell,
        where: str = "distribute_datasets_from_function",
    ):
        super().__init__(strategy, options)
        self.where = where  # make_input_fn_iterator's errors name it
        self._source = source
        self._cell = spec
        self._restart()

    def _restart(self) -> None:
        """Forget this iterator's pass: the next read opens the source's (restored) position."""
        self._it: Iterator[Any] | None = None
        self._serial = 0
        self._pending: Any = _UNKNOWN
        self._exhausted = False
        self._done = False
        self._batches = 0
        self._examples = 0

    def _pull(self) -> tuple[Any, MpistratError | None, BaseException | None]:
        """The next local batch (or ``END``), with the error and its cause if reading failed."""
        if self._pending is not _UNKNOWN:
            pending, self._pending = self._pending, _UNKNOWN
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
        if self._cell.value is not _UNKNOWN:
            return self._cell.value
        if self._pending is _UNKNOWN:
            self._pending = self._pull()
        batch, error, cause = self._pending
        if error is not None:
            raise error from cause
        return batch.spec if isinstance(batch, Batch) else None

    def _step(self) -> Any:
        if self._done:
            return END
        require_spmd("get_next")
        collectives = self._strategy.extended.collectives
        batch, error, cause = self._pull()
        have = isinstance(batch, Batch)
        spec = self._cell.value
        if spec is _UNKNOWN:
            try:
                spec = agree_element_spec(self._strategy, batch, error, self.where)
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
                describe=lambda: _describe(batch, spec),
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
        self._source.took(self._serial)
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
