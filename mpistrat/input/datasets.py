"""The distributed datasets of ``experimental_distribute_dataset`` and ``distribute_datasets_from_function``.

Each is handed the ranks' :class:`~mpistrat.collectives.Collectives` (its rank, size and
collectives are all it uses) and an ``owner``, whoever made it, that only its checkpoint
entry hands back.

>>> import numpy as np
>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> dist = distribute_dataset(Collectives(MPI.COMM_SELF.Dup()), [np.arange(4), np.arange(4, 6)])
>>> [x.tolist() for x in dist]
[[0, 1, 2, 3], [4, 5]]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from mpistrat.errors import InvalidArgumentError, MpistratError
from mpistrat.input.batches import examine
from mpistrat.input.contexts import InputContext, InputOptions, InputReplicationMode, handed, require_spmd
from mpistrat.input.iterators import DistributedIterator, Optional, SplitIterator
from mpistrat.input.pipelines import PipelineIterator, SpecCell
from mpistrat.input.position import InputPosition
from mpistrat.input.source import END, UNKNOWN, Source, wrap_user_error
from mpistrat.interface import modes

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = [
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "InputIterator",
    "distribute_dataset",
    "distribute_datasets_from_function",
    "input_position",
    "make_dataset_iterator",
    "make_input_fn_iterator",
]


def _options(options: InputOptions | None, where: str) -> InputOptions:
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise InvalidArgumentError(
            f"{where}: options must be an InputOptions or None; got {type(options).__name__}"
        )
    return options


def _require_cross_replica(where: str) -> None:
    require_spmd(where)
    modes.require_cross_replica(where)


class DistributedDataset:
    """Global batches split across replicas; iterate it on every rank together.

    Every rank reads the whole dataset and keeps its part of each global batch,
    so the dataset must yield the same global batches, in the same order, on every
    rank (a deterministic loader, or one shuffled with a seed all ranks share).
    From an :class:`~mpistrat.ArrayDataset` each rank gathers only its own rows.
    """

    def __init__(
        self, collectives: Collectives, dataset: Iterable[Any], options: InputOptions, owner: object = None
    ):
        self._collectives = collectives
        self._owner = owner
        self._options = options
        # An ArrayDataset yields checked global batches whose rows each replica gathers for itself.
        self._source = Source(dataset, SplitIterator.where)
        self._spec: Any = UNKNOWN

    def __iter__(self) -> DistributedIterator:
        require_spmd("iter(distributed dataset)")
        return SplitIterator(self._collectives, self._source, self._options, self._owner)

    @property
    def element_spec(self) -> Any:
        """This replica's element: the global batch's nest with an ``ArraySpec`` per leaf (no communication).

        None for an empty dataset. Reading it peeks at the first global batch, which
        the next iteration still yields.
        """
        if self._spec is UNKNOWN:
            first = self._source.peek()
            self._spec = None if first is END else examine(first, SplitIterator.where, unbatched=True).spec
        return self._spec

    def checkpoint_position(self, restart: Callable[[], None] | None = None) -> InputPosition:
        """Where this dataset stands (its latest pass), as a checkpoint saves it; ``restart``: what
        makes an iterator of it resume the restored pass."""
        return InputPosition(
            SplitIterator.where, self._collectives, self._source, False, restart, self._owner
        )

    def __repr__(self) -> str:
        return f"DistributedDataset({self._source.iterable!r}, replicas={self._collectives.size})"


class DistributedDatasetsFromFunction:
    """One input pipeline per rank, made by ``dataset_fn(input_context)``; lengths may differ."""

    def __init__(
        self,
        collectives: Collectives,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        options: InputOptions,
        where: str = PipelineIterator.where,
        owner: object = None,
    ):
        if not callable(dataset_fn):
            raise InvalidArgumentError(
                f"{where}: dataset_fn must be callable; got {type(dataset_fn).__name__}"
            )
        collectives.require_open()
        self._collectives = collectives
        self._owner = owner
        self._options = options
        self._where = where  # make_input_fn_iterator's errors name it
        self._spec = SpecCell()
        self.input_context = InputContext(collectives.size, collectives.rank, collectives.size)
        error, cause, source = None, None, None
        try:
            source = Source(dataset_fn(self.input_context), where)
        except Exception as exc:
            error, cause = wrap_user_error(exc, where), (None if isinstance(exc, MpistratError) else exc)
        # Every rank learns whether dataset_fn failed anywhere, so none goes on to wait for it.
        try:
            collectives.agree(where, error=error)
        except MpistratError as exc:
            if cause is not None:
                raise exc from cause
            raise
        if source is None:  # agree raised above when dataset_fn failed, here or on any rank
            raise MpistratError(f"{where}: dataset_fn made no pipeline")
        self._source = source

    def __iter__(self) -> DistributedIterator:
        require_spmd("iter(distributed dataset)")
        return PipelineIterator(
            self._collectives, self._source, self._options, self._spec, self._where, self._owner
        )

    @property
    def element_spec(self) -> Any:
        """The per-replica element: once an iterator took a step, the spec every pipeline agreed on.

        Before that (no communication): the spec of this rank's first batch, or None
        if this rank's pipeline is empty. Peeking does not lose the batch. A pipeline
        of unbatched elements has their whole shapes, as tf's (``ArraySpec((), int64)``
        for ``range``).
        """
        if self._spec.value is not UNKNOWN:
            return self._spec.value
        first = self._source.peek()
        return None if first is END else examine(first, self._where, unbatched=True).spec

    def checkpoint_position(self, restart: Callable[[], None] | None = None) -> InputPosition:
        """Where this dataset stands (its latest pass), as a checkpoint saves it; ``restart``: what
        makes an iterator of it resume the restored pass."""
        return InputPosition(self._where, self._collectives, self._source, True, restart, self._owner)

    def __repr__(self) -> str:
        return f"DistributedDatasetsFromFunction({self.input_context!r})"


class InputIterator:
    """The iterator of ``make_dataset_iterator`` / ``make_input_fn_iterator``.

    ``initialize()`` starts (or restarts) a pass over the input and returns ``[]``;
    ``get_next()`` initializes on first use if needed.
    """

    def __init__(self, dataset: DistributedDataset | DistributedDatasetsFromFunction):
        self._dataset = dataset
        self._iterator: DistributedIterator | None = None

    def initialize(self) -> list[Any]:
        """Start a new pass over the input (no communication). Returns ``[]`` (no ops to run)."""
        self._iterator = iter(self._dataset)
        return []

    def _forget(self) -> None:
        """After a restore: the next ``get_next`` opens the restored pass."""
        self._iterator = None

    def checkpoint_position(self) -> InputPosition:
        """Where the input stands, as a checkpoint saves it; restoring resumes the restored pass."""
        return self._dataset.checkpoint_position(self._forget)

    def _current(self) -> DistributedIterator:
        if self._iterator is None:
            self.initialize()
        assert self._iterator is not None
        return self._iterator

    def get_next(self) -> Any:
        """This replica's next batch; ``StopIteration`` at the end of the data."""
        return self._current().get_next()

    def get_next_as_optional(self) -> Optional:
        return self._current().get_next_as_optional()

    def __iter__(self) -> InputIterator:
        return self

    def __next__(self) -> Any:
        return self.get_next()

    @property
    def element_spec(self) -> Any:
        return self._dataset.element_spec


def distribute_dataset(
    collectives: Any,
    dataset: Iterable[Any],
    options: InputOptions | None = None,
    owner: object = None,
) -> DistributedDataset:
    """``experimental_distribute_dataset``: split each global batch across replicas."""
    where = SplitIterator.where
    _require_cross_replica(where)
    opts = _options(options, where)
    if opts.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
        raise InvalidArgumentError(
            f"{where}: InputReplicationMode.PER_REPLICA is only supported in "
            "`distribute_datasets_from_function`."
        )
    ranks, owner = handed(collectives, owner)
    return DistributedDataset(ranks, dataset, opts, owner)


def distribute_datasets_from_function(
    collectives: Any,
    dataset_fn: Callable[[InputContext], Iterable[Any]],
    options: InputOptions | None = None,
    where: str = PipelineIterator.where,
    owner: object = None,
) -> DistributedDatasetsFromFunction:
    """``distribute_datasets_from_function``: one pipeline per rank (collective).

    Each pipeline yields batches, or unbatched elements (one per replica per step, as tf).
    """
    _require_cross_replica(where)
    ranks, owner = handed(collectives, owner)
    return DistributedDatasetsFromFunction(ranks, dataset_fn, _options(options, where), where, owner)


def make_dataset_iterator(collectives: Any, dataset: Iterable[Any], owner: object = None) -> InputIterator:
    """``make_dataset_iterator``: an :class:`InputIterator` over split global batches."""
    return InputIterator(distribute_dataset(collectives, dataset, owner=owner))


def make_input_fn_iterator(
    collectives: Any,
    input_fn: Callable[[InputContext], Iterable[Any]],
    replication_mode: InputReplicationMode | str = InputReplicationMode.PER_WORKER,
    owner: object = None,
) -> InputIterator:
    """``make_input_fn_iterator``: an :class:`InputIterator`, one pipeline per rank (collective)."""
    mode = InputReplicationMode.from_any(replication_mode)
    options = InputOptions(experimental_replication_mode=mode)
    return InputIterator(
        distribute_datasets_from_function(collectives, input_fn, options, "make_input_fn_iterator", owner)
    )


def input_position(obj: Any) -> InputPosition | None:
    """The checkpoint entry for a distributed dataset's or iterator's position; None for anything else.

    A dataset's position is that of its latest pass (passes completed, and global batches
    taken in the pass in progress); restoring into an iterator makes it resume the restored pass.
    """
    if isinstance(obj, _POSITIONED):
        return obj.checkpoint_position()
    return None


_POSITIONED = (DistributedDataset, DistributedDatasetsFromFunction, InputIterator, DistributedIterator)
