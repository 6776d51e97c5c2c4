"""StrategyExtended: the communicator, devices and lower-level APIs behind a Strategy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from mpistrat import watchdog
from mpistrat.collectives import Collectives
from mpistrat.errors import ContextError
from mpistrat.options import CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.replica_context import ReplicaContext
    from mpistrat.strategy import Strategy

__all__ = ["StrategyExtended"]


class StrategyExtended:
    """Additional APIs for algorithms that need to be distribution-aware.

    Owns the strategy's private communicator (a duplicate, so mpistrat's messages
    never meet the application's) and its :class:`~mpistrat.collectives.Collectives`.
    """

    def __init__(
        self,
        container_strategy: Strategy,
        comm: MPI.Intracomm,
        options: CommunicationOptions,
        *,
        is_default: bool = False,
    ):
        self._container_strategy = container_strategy
        self._comm: MPI.Intracomm | None = comm
        self._options = options
        self._collectives = Collectives(comm, options)
        self.is_default = is_default
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        # Writes to synced variables made inside a merge_fn on rank 0; broadcast with its result.
        self.merge_writes: list[tuple[int, Any]] | None = None
        self._synced: dict[int, Any] = {}
        from mpistrat.replica_context import ReplicaContext

        self.default_replica_context: ReplicaContext = ReplicaContext(container_strategy, 0)

    @property
    def collectives(self) -> Collectives:
        if self._comm is None:
            raise ContextError(
                "this strategy was finalized (experimental_finalize); create a new MPIStrategy"
            )
        return self._collectives

    @property
    def communicator(self) -> MPI.Intracomm:
        """The strategy's private communicator."""
        return self.collectives.comm

    @property
    def communication_options(self) -> CommunicationOptions:
        return self._options

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The device of this rank's replica."""
        return (f"/job:worker/replica:0/task:{self.rank}/device:CPU:0",)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Where variables live: on every replica's device; this rank holds its own copy."""
        return self.worker_devices

    @property
    def experimental_require_static_shapes(self) -> bool:
        """False: all_gather and distributed datasets handle varying shapes."""
        return False

    def register_synced(self, obj: Any) -> int:
        """Give ``obj`` a key that is the same on every rank (objects are created in the same order)."""
        key = len(self._synced)
        self._synced[key] = obj
        return key

    def apply_merge_writes(self, writes: list[tuple[int, Any]]) -> None:
        """Replay on this rank the writes rank 0's merge_fn made to synced objects."""
        for key, payload in writes:
            self._synced[key].apply_merge_write(payload)

    def finalize(self) -> None:
        if self._comm is not None and not self.is_default:
            watchdog.unwatch(self._collectives.monitor)  # its thread must not touch a freed communicator
            self._comm.Free()
        self._comm = None
