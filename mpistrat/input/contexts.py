"""What an input or value function is told about its place: InputContext, ValueContext, InputOptions.

On MPI one rank is one worker and one replica, so a rank has exactly one input
pipeline: ``input_pipeline_id`` is the rank, ``num_input_pipelines`` the number of ranks.

>>> ctx = InputContext(num_input_pipelines=4, input_pipeline_id=1, num_replicas_in_sync=4)
>>> ctx.get_per_replica_batch_size(64)
16
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpistrat.errors import ContextError, InvalidArgumentError, enum_member
from mpistrat.interface import modes

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = [
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "ValueContext",
    "distribute_values_from_function",
    "require_spmd",
]

UNEVEN_MODES = ("pad", "drop", "error")


class InputReplicationMode(enum.Enum):
    """How input functions are replicated: one pipeline per worker or per replica.

    On MPI a worker is a rank and holds one replica, so both mean one pipeline per rank.
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"

    @classmethod
    def from_any(cls, mode: InputReplicationMode | str) -> InputReplicationMode:
        return enum_member(cls, mode, "replication_mode", "InputReplicationMode.PER_WORKER or PER_REPLICA")


def _check_index(name: str, value: Any, low: int, high: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value >= high)
    ):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise InvalidArgumentError(f"{name} must be an int {bound}; got {value!r}")
    return value


class InputContext:
    """Information about the input pipeline a ``dataset_fn`` / ``input_fn`` builds.

    >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=0, num_replicas_in_sync=2)
    >>> ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync
    (2, 0, 2)

    Shard the data with ``input_pipeline_id`` (of ``num_input_pipelines``) and batch
    it with ``get_per_replica_batch_size(global_batch_size)``.
    """

    def __init__(
        self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1
    ):
        self._num_input_pipelines = _check_index("num_input_pipelines", num_input_pipelines, 1)
        self._input_pipeline_id = _check_index("input_pipeline_id", input_pipeline_id, 0, num_input_pipelines)
        self._num_replicas_in_sync = _check_index("num_replicas_in_sync", num_replicas_in_sync, 1)

    @property
    def num_input_pipelines(self) -> int:
        """The number of input pipelines (the number of ranks)."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """This pipeline's id, in ``[0, num_input_pipelines)`` (the rank)."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas kept in sync."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``, which must divide evenly.

        >>> InputContext(num_replicas_in_sync=3).get_per_replica_batch_size(10)
        Traceback (most recent call last):
        ...
        mpistrat.errors.InvalidArgumentError: The `global_batch_size` 10 is not divisible by ...
        """
        _check_index("global_batch_size", global_batch_size, 0)
        if global_batch_size % self._num_replicas_in_sync:
            raise InvalidArgumentError(
                f"The `global_batch_size` {global_batch_size} is not divisible by `num_replicas_in_sync` "
                f"{self._num_replicas_in_sync}; pick a global batch size that is a multiple of the number "
                "of replicas, or batch each pipeline with a size of your own"
            )
        return global_batch_size // self._num_replicas_in_sync

    def __str__(self) -> str:
        """tf's form, with this package's name.

        >>> str(InputContext(num_input_pipelines=3, input_pipeline_id=1, num_replicas_in_sync=42))
        'mpistrat.InputContext(input pipeline id 1, total: 3)'
        """
        pipeline, total = self._input_pipeline_id, self._num_input_pipelines
        return f"mpistrat.InputContext(input pipeline id {pipeline}, total: {total})"

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, num_replicas_in_sync={self._num_replicas_in_sync})"
        )


class ValueContext:
    """What ``value_fn`` of ``experimental_distribute_values_from_function`` is told.

    >>> ValueContext(1, 2)
    ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)
    """

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self._num_replicas_in_sync = _check_index("num_replicas_in_sync", num_replicas_in_sync, 1)
        self._replica_id = _check_index(
            "replica_id_in_sync_group", replica_id_in_sync_group, 0, num_replicas_in_sync
        )

    @property
    def replica_id_in_sync_group(self) -> int:
        """The replica this value is for (the rank)."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas kept in sync."""
        return self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self._replica_id}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """How a distributed dataset is iterated.

    >>> InputOptions(uneven="drop").uneven
    'drop'

    Args:
        uneven: what to do at a step where some replica has no data (a pipeline of
            ``distribute_datasets_from_function`` ran out before the others, or a short
            global batch leaves a replica without examples): ``"pad"`` (default) gives
            that replica an empty batch and goes on, so no example is lost; ``"drop"``
            ends the epoch there; ``"error"`` raises on every rank, naming the ranks
            and their counts.
        experimental_replication_mode: one pipeline per worker or per replica; the
            same on MPI. ``PER_REPLICA`` is only for ``distribute_datasets_from_function``.
        experimental_fetch_to_device: accepted for code ported from tf.distribute;
            batches stay where the dataset made them (NumPy or CuPy).
        experimental_per_replica_buffer_size: accepted for ported code; no prefetching
            happens (each rank reads its input when asked).
    """

    uneven: str = "pad"
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_fetch_to_device: bool | None = None
    experimental_per_replica_buffer_size: int = 1

    def __post_init__(self) -> None:
        if self.uneven not in UNEVEN_MODES:
            raise InvalidArgumentError(
                f"InputOptions.uneven must be one of {UNEVEN_MODES}; got {self.uneven!r}"
            )
        mode = InputReplicationMode.from_any(self.experimental_replication_mode)
        object.__setattr__(self, "experimental_replication_mode", mode)
        _check_index("experimental_per_replica_buffer_size", self.experimental_per_replica_buffer_size, 1)


def require_spmd(method: str) -> modes.Mode:
    """The current mode, if every rank executes here (not inside a ``merge_fn``)."""
    mode = modes.current_mode()
    if mode.kind is modes.MERGE:
        raise ContextError(
            f"{method} cannot be called inside a merge_fn: merge_fn runs on rank 0 alone, "
            "and reading distributed input needs every rank"
        )
    return mode


def handed(collectives: Any, owner: object = None) -> tuple[Collectives, object]:
    """The ``Collectives`` the public input functions were handed, and who owns what they make.

    They take a ``Collectives``; ported code hands them a strategy, as they took before: then its
    collectives are used, and the strategy owns the result (what a checkpoint of it asks).
    """
    extended = getattr(collectives, "extended", None)
    return (collectives, owner) if extended is None else (extended.collectives, collectives)


def distribute_values_from_function(collectives: Any, value_fn: Callable[[ValueContext], Any]) -> Any:
    """``value_fn(ValueContext(rank, R))`` on this rank: this replica's value, ready for ``run``.

    >>> from mpi4py import MPI
    >>> from mpistrat.collectives import Collectives
    >>> ranks = Collectives(MPI.COMM_SELF.Dup())
    >>> distribute_values_from_function(ranks, lambda ctx: ctx.replica_id_in_sync_group * 10)
    0
    """
    if not callable(value_fn):
        raise InvalidArgumentError(f"value_fn must be callable; got {type(value_fn).__name__}")
    mode = require_spmd("experimental_distribute_values_from_function")
    if mode.replica_context is not None and mode.kind is not modes.DEFAULT:
        modes.require_cross_replica("experimental_distribute_values_from_function")
    ranks, _ = handed(collectives)
    return value_fn(ValueContext(ranks.rank, ranks.size))
