"""What the layers below ``distribute/`` may use of a strategy: typed interfaces, as torch's
``ProcessGroup`` is the interface its lower layers see.

``input/``, ``training/`` and ``checkpoint/`` and the modes are typed against these protocols,
never against ``Strategy``, ``StrategyExtended`` or ``ReplicaContext`` (which live above them and
satisfy the protocols by their shape). They reach what a strategy's replicas share (rank, size,
collectives, the writes of its synced variables, updates) through ``strategy.extended``, tf's name,
typed by :class:`StrategyExtendedProtocol`.

>>> import mpistrat
>>> strategy = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
>>> isinstance(strategy, StrategyProtocol), isinstance(strategy.extended, StrategyExtendedProtocol)
(True, True)
>>> strategy.extended.rank, strategy.extended.size
(0, 1)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["ReplicaContextProtocol", "StrategyExtendedProtocol", "StrategyProtocol", "SyncedWrites"]


@runtime_checkable
class StrategyExtendedProtocol(Protocol):
    """A strategy's ``extended``, as the layers below ``distribute/`` use it (``StrategyExtended``
    is one). ``collectives`` raises the strategy's "finalized" error once the strategy is freed."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def default_replica_context(self) -> ReplicaContextProtocol: ...

    @property
    def collectives(self) -> Collectives: ...

    @property
    def writes(self) -> SyncedWrites:
        """What cross-replica writes to the strategy's synced variables do now."""
        ...

    @property
    def parameter_devices(self) -> tuple[str, ...]: ...

    def register_synced(self, obj: Any) -> int:
        """A key for ``obj``, the same on every rank (synced objects are made in the same order)."""
        ...

    def writes_in_sync(self) -> contextlib.AbstractContextManager[None]:
        """Writes inside are the same on every rank by construction, so they are not compared."""
        ...

    def colocate_vars_with(self, colocate_with_variable: Any) -> contextlib.AbstractContextManager[None]: ...

    def non_slot_devices(self, var_list: Any) -> tuple[str, ...]: ...

    def update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any: ...


@runtime_checkable
class StrategyProtocol(Protocol):
    """A strategy, as the layers below ``distribute/`` see it."""

    @property
    def extended(self) -> StrategyExtendedProtocol: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    def scope(self) -> contextlib.AbstractContextManager[Any]: ...

    def run(
        self, fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any: ...


@runtime_checkable
class ReplicaContextProtocol(Protocol):
    """A replica context, as the layers below ``distribute/`` see it."""

    @property
    def strategy(self) -> StrategyProtocol: ...

    @property
    def replica_id_in_sync_group(self) -> int: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    def merge_call(
        self, merge_fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any: ...

    def all_reduce(self, reduce_op: Any, value: Any, options: Any = None) -> Any: ...


class SyncedWrites:
    """What cross-replica writes to one strategy's synced variables do now: state the strategy's
    ``merge_call`` and ``update`` set, and its variables (handed it at creation) read, as a
    communication hook's state object is handed to the hook.

    ``merged``: a list while a merge_fn runs (between :meth:`record` and :meth:`stop`, which
    merge_call calls), into which the variables record the writes made there, as ``(key, payload)``;
    rank 0 broadcasts them (root mode), or the ranks compare them (every rank); None otherwise.
    ``in_sync``: above 0 inside ``update()`` and ``writes_in_sync()``, whose writes are the same on
    every rank by construction (computed from reduced values), so they apply to each rank's copy as
    they are, unchecked.

    >>> writes = SyncedWrites()
    >>> merged = writes.record()
    >>> writes.merged.append((0, "payload"))
    >>> writes.stop()
    >>> merged, writes.merged, writes.in_sync
    ([(0, 'payload')], None, 0)
    """

    __slots__ = ("in_sync", "merged")

    def __init__(self) -> None:
        self.merged: list[tuple[int, Any]] | None = None
        self.in_sync = 0

    def record(self) -> list[tuple[int, Any]]:
        """Start recording the writes made from now on (in a merge_fn); the list they go into."""
        merged: list[tuple[int, Any]] = []
        self.merged = merged
        return merged

    def stop(self) -> None:
        """Stop recording (the merge_fn returned or raised)."""
        self.merged = None
