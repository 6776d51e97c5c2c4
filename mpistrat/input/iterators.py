"""Iterators over distributed input, and how the ranks agree at every step.

:class:`DistributedIterator` is what every iterator gives (``next``, ``get_next``,
``get_next_as_optional``, ``element_spec``). Its two kinds differ in how a step reads
the data: :class:`SplitIterator` here (``experimental_distribute_dataset``) and
:class:`~mpistrat.input.pipelines.PipelineIterator` (``distribute_datasets_from_function``).

``SplitIterator``: every rank reads the same global batch and keeps its own part, so
the ranks need not talk; while checking is on, one small handshake per step (kind
``dataset_step``) makes sure they really did read the same batches, so a dataset that
differs between ranks raises everywhere instead of deadlocking a later collective.

No iterator may be stepped inside ``run``: ``next(iterator)`` there raises, as tf's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mpistrat import nest
from mpistrat.collectives import check_enabled
from mpistrat.collectives.fingerprint import checksum, hash64
from mpistrat.diagnostics import ulfm
from mpistrat.errors import CollectiveMismatchError, InvalidArgumentError, MpistratError, PeerFailedError
from mpistrat.input.batches import Batch, Rows, examine, replica_range, split_batch
from mpistrat.input.batches import fingerprint as batch_fingerprint
from mpistrat.input.contexts import InputOptions, require_spmd
from mpistrat.input.elements import Elements
from mpistrat.input.position import InputPosition
from mpistrat.input.source import END, UNKNOWN, Source, wrap_user_error
from mpistrat.interface import modes

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = [
    "DistributedIterator",
    "Optional",
    "Replay",
    "SplitIterator",
    "describe_step",
    "refuse_in_replica_fn",
]

_END_CODE = hash64("end of data")
_CODE_BITS = (1 << 62) - 1  # what a handshake slot holds with room for its negation


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
    pipelines = False  # each rank reads its own pipeline (a checkpoint keeps every rank's position)
    _source: Source

    def __init__(self, collectives: Collectives, options: InputOptions, owner: object = None):
        self._collectives = collectives  # the ranks' collectives: rank, size, the step's handshakes
        self._owner = owner  # whoever made the dataset, handed back in its checkpoint entry
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

        Called outside ``run``, as tf requires: inside it raises ``InvalidArgumentError``
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

    def checkpoint_position(self) -> InputPosition:
        """Where this iterator's input stands, as a checkpoint saves it; restoring it makes this
        iterator resume the restored pass."""
        return InputPosition(
            self.where, self._collectives, self._source, self.pipelines, self._restart, self._owner
        )

    def _restart(self) -> None:
        """Forget this iterator's pass: the next read opens the source's (restored) position."""
        self._it: Iterator[Any] | None = None
        self._serial = 0
        self._pending: Any = UNKNOWN
        self._done = False

    def _step(self) -> Any:
        raise NotImplementedError

    def _finish(self, exc: MpistratError, cause: BaseException | None) -> None:
        self._done = True
        if cause is not None:
            raise exc from cause
        raise exc


class SplitIterator(DistributedIterator):
    """Each rank reads the same global batch and keeps ``replica_range`` of it."""

    where = "experimental_distribute_dataset"

    def __init__(self, collectives: Collectives, source: Source, options: InputOptions, owner: object = None):
        super().__init__(collectives, options, owner)
        self._source = source
        self._spec: Any = UNKNOWN
        self._restart()
        collectives.recoverables.add(self)  # moved back and re-split after a rank's death

    def _restart(self) -> None:
        super()._restart()
        self._replay = Replay()
        self._last: Any = None  # the batch handed out last (see renewed)

    def _read(self) -> Any:
        raw = self._replay.next()
        if raw is not END:
            return raw
        if self._pending is not UNKNOWN:
            raw, self._pending = self._pending, UNKNOWN
        else:
            if self._it is None:
                self._it, self._serial = self._source.open()
            raw = next(self._it, END)
        if raw is not END:
            self._replay.read(raw)
        return raw

    def recovery_facts(self) -> None:
        return None

    def renewed(self, held: set[int]) -> dict[int, Any] | None:
        """After a recovery: if a caller holds any leaf of the batch this iterator handed out last (``held``:
        the ``id`` of each leaf it holds), this iterator reads that global batch again (it was moved
        back), split over the survivors, and maps each old leaf's ``id`` to its new leaf; else None.
        Collective, as a step."""
        last = nest.flatten(self._last) if self._last is not None else []
        if not any(id(leaf) in held for leaf in last):
            return None
        return dict(zip(map(id, last), nest.flatten(self._step()), strict=False))

    def recover(self, recovery: Any, facts: list[Any]) -> None:
        """After a rank's death: the global batches read since the optimizer step the survivors go on
        from are read again (split over the survivors, by the next steps), so that every example
        of a step no survivor completed is still taken once (no communication)."""
        for examples in self._replay.rewind(recovery.step):
            self._source.untook(self._serial, examples)
            self._steps -= 1

    def _read_step(self) -> Batch | Elements | Any:
        """The next global batch, or the next unbatched elements, one per replica (see ``elements.py``)."""
        raw = self._read()
        if raw is END:
            return END
        first = examine(raw, self.where, unbatched=True)
        if first.batched:
            return first
        elements = [first]
        while len(elements) < self._collectives.size and (raw := self._read()) is not END:
            element = examine(raw, self.where, unbatched=True)
            if element.batched:
                raise InvalidArgumentError(
                    f"{self.where}: the dataset yields unbatched elements (a leaf with no dimension), then a "
                    "batch; yield all batches or all unbatched elements"
                )
            elements.append(element)
        return Elements(elements)

    @property
    def element_spec(self) -> Any:
        if self._spec is UNKNOWN:
            self._pending = self._read()
            first = self._pending
            self._spec = None if first is END else examine(first, self.where, unbatched=True).spec
        return self._spec

    def _step(self) -> Any:
        if self._done:
            return END
        require_spmd("get_next")
        collectives = self._collectives
        collectives.require_open()
        while True:
            try:
                self._last = self._step_once(collectives)
                return self._last
            except PeerFailedError:
                self._replay.unread()  # this step's global batch is read again, over the survivors
                recover = getattr(self._owner, "recover", None)
                if recover is None or not ulfm.live():
                    raise
                recover()  # every survivor takes part, wherever it learned of the death

    def _step_once(self, collectives: Collectives) -> Any:
        batch, error, cause = END, None, None
        try:
            batch = self._read_step()
        except Exception as exc:
            error, cause = wrap_user_error(exc, self.where), (None if isinstance(exc, MpistratError) else exc)
        if check_enabled(collectives):
            fingerprint = _END_CODE
            if isinstance(batch, Batch):
                fingerprint = batch_fingerprint(
                    batch.treespec, batch.leaves, shapes=True, memo=collectives.caches.codes
                ) ^ _rows_code(batch)
            elif isinstance(batch, Elements):
                fingerprint = batch.fingerprint(collectives.caches.codes)
            try:
                collectives.agree(
                    "dataset_step",
                    fingerprint=fingerprint,
                    describe=lambda: describe_step(batch),
                    error=error,
                )
            except PeerFailedError:
                raise  # not this iterator's end: the survivors go on
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
        size, rank = collectives.size, collectives.rank
        if self._spec is UNKNOWN:
            self._spec = batch.spec
        elements = isinstance(batch, Elements)
        counts = [stop - start for start, stop in (replica_range(batch.size, size, r) for r in range(size))]
        if elements:
            counts = [int(r < batch.size) for r in range(size)]
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
        if elements:  # each element is one item of the user's iterable: the source counts items read
            for _ in range(batch.size):
                self._source.took(self._serial, 1)
            self._replay.taken(collectives.commits, [1] * batch.size)
            return batch.take(rank, size)
        self._source.took(self._serial, batch.size)
        self._replay.taken(collectives.commits, [batch.size])
        return split_batch(batch, size, rank)


class Replay:
    """The global batches a :class:`SplitIterator` read since the last optimizer steps, to read again
    after a rank's death (kept only where a death can be survived: ``ulfm.live()``).

    Each step that handed out a batch is kept with the optimizer steps applied when it was read;
    :meth:`rewind` to a step puts back the batches read from that step on, newest last, for the
    next reads. A batch read but not handed out (its step's handshake found a death) is put back
    by :meth:`unread`.

    >>> replay = Replay(keep=True)
    >>> for raw in "ab":
    ...     replay.read(raw); replay.taken(commits=0, counts=[4])
    >>> replay.rewind(0), replay.next(), replay.next()
    ([4, 4], 'a', 'b')
    """

    def __init__(self, keep: bool | None = None) -> None:
        self.keep = ulfm.live() if keep is None else keep
        self.reading: list[Any] = []  # raw items read for the step in progress
        self.steps: list[tuple[int, list[Any], list[int]]] = []  # (commits when read, raws, examples)
        self.queue: list[Any] = []  # raws to read again, next first

    def read(self, raw: Any) -> None:
        if self.keep:
            self.reading.append(raw)

    def next(self) -> Any:
        """The next raw item to read again (``END``: none)."""
        if not self.queue:
            return END
        raw = self.queue.pop(0)
        self.read(raw)
        return raw

    def taken(self, commits: int, counts: list[int]) -> None:
        """The step in progress handed out its batch, ``counts`` examples as the source counted them."""
        if not self.keep:
            return
        self.steps = [s for s in self.steps if s[0] >= commits - 1]  # older ones are never read again
        self.steps.append((commits, self.reading, counts))
        self.reading = []

    def unread(self) -> None:
        """The step in progress failed: its items are read again first."""
        self.queue[:0], self.reading = self.reading, []

    def rewind(self, step: int) -> list[int]:
        """Put back every batch read once ``step`` optimizer steps were applied, or later; the examples
        the source counted for them (to take back)."""
        again = [s for s in self.steps if s[0] >= step]
        self.steps = [s for s in self.steps if s[0] < step]
        self.queue[:0] = [raw for _, raws, _ in again for raw in raws] + self.reading
        self.reading = []
        return [n for _, _, counts in again for n in counts]


def refuse_in_replica_fn() -> None:
    """tf's check in ``get_next``: reading the next element inside ``run`` is an error.

    Local (every rank runs the same ``replica_fn``, so every rank raises); the default
    replica context, outside any scope, is not inside ``run``.
    """
    mode = modes.current_mode()
    if mode.replica_context is not None and mode.kind is not modes.DEFAULT:
        raise InvalidArgumentError(
            "next(iterator) should be called from outside of replica_fn. "
            "e.g. strategy.run(replica_fn, args=(next(iterator),))"
        )


def _rows_code(batch: Batch) -> int:
    """A checksum of the rows a shuffled or sharded ArrayDataset's global batch holds (0 otherwise):
    ranks at different positions of the dataset read batches of the same shapes but other rows."""
    rows = next((a for a in batch.leaves if isinstance(a, Rows)), None)
    return 0 if rows is None else checksum(rows.index) & _CODE_BITS


def describe_step(batch: Any, spec: Any = None) -> dict[str, Any]:
    """This rank's step, in the form the handshake compares to explain a mismatch."""
    if isinstance(batch, Elements):
        return {"leaves": batch.describe()}
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
