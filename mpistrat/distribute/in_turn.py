"""``strategy.run`` inside a root-mode merge_fn: rank 0 runs every replica's ``fn`` in turn.

Rank 0 holds every replica's arguments there, so it calls ``fn`` once per replica, as tf's
MirroredStrategy does on its devices. Each replica runs in a thread of its own, one at a time,
so that a ``merge_call`` inside ``fn`` can wait for the other replicas to reach theirs, as tf's
replica threads do: ``merge_fn`` then runs once with every replica's arguments, and each replica
goes on with its own part of the result. Nothing here communicates (``fn`` may not: see
``modes.Mode``), and an exception in ``fn`` or ``merge_fn`` reaches the caller as it was raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpistrat import nest
from mpistrat.distribute.merge import regroup, select
from mpistrat.distribute.replica_context import ReplicaContext
from mpistrat.errors import ContextError
from mpistrat.interface import modes

if TYPE_CHECKING:
    from mpistrat.distribute.strategy_base import Strategy

__all__ = ["run_in_turn"]


class _Stopped(BaseException):
    """Ends a replica's thread that waits in merge_call after another replica failed."""


class _Replica:
    """One replica's ``fn`` in a thread that runs only while the caller waits for it (:meth:`step`)."""

    def __init__(self, strategy: Strategy, replica: int, fn: Callable[..., Any], args: Any, kwargs: Any):
        self.context = ReplicaContext(strategy, replica)
        self.context._in_turn = self  # its merge_call comes here (see ReplicaContext.merge_call)
        self.mode = modes.Mode(strategy, self.context, modes.MERGE)
        self.call = (fn, args, kwargs)
        self.merge: tuple[Callable[..., Any], Any] | None = None  # (merge_fn, (args, kwargs)) pending
        self.merged: Any = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = self.stopped = False
        self._go, self._paused = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"replica {replica}", daemon=True)

    def _main(self) -> None:
        self._go.wait()
        self._go.clear()
        fn, args, kwargs = self.call
        try:
            with modes.push(self.mode):
                self.result = fn(*args, **kwargs)
        except _Stopped:
            pass
        except BaseException as exc:
            self.error = exc
        finally:
            self.done = True
            self._paused.set()

    def step(self) -> None:
        """Let the replica run until it calls merge_call or returns."""
        self._paused.clear()
        if not self._thread.is_alive() and not self.done:
            self._thread.start()
        self._go.set()
        self._paused.wait()

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """In the replica's thread: hand the call over, wait for every replica's, return this one's part."""
        self.merge = (merge_fn, (tuple(args), dict(kwargs)))
        self._paused.set()
        self._go.wait()
        self._go.clear()
        if self.stopped:
            raise _Stopped
        return self.merged

    def stop(self) -> None:
        if not self.done and self._thread.is_alive():
            self.stopped = True
            self._go.set()
            self._thread.join()


def run_in_turn(strategy: Strategy, fn: Callable[..., Any], calls: list[tuple[Any, Any]]) -> list[Any]:
    """``fn(*args, **kwargs)`` for each replica's ``(args, kwargs)`` in ``calls``; their results in order."""
    replicas = [_Replica(strategy, r, fn, a, kw) for r, (a, kw) in enumerate(calls)]
    try:
        while True:
            for replica in replicas:
                if not replica.done:
                    replica.step()
            failed = next((r for r in replicas if r.error is not None), None)
            if failed is not None:
                raise failed.error  # type: ignore[misc]
            if all(r.done for r in replicas):
                return [r.result for r in replicas]
            if any(r.done for r in replicas):
                raise ContextError(  # a RuntimeError, as tf's
                    "Some replicas made a different number of replica_context().merge_call() calls "
                    "(strategy.run inside a merge_fn)."
                )
            _merge(strategy, replicas)
    finally:
        for replica in replicas:
            replica.stop()


def _merge(strategy: Strategy, replicas: list[_Replica]) -> None:
    """Every replica waits in merge_call: run the first one's merge_fn once with every replica's arguments."""
    merge_fn = replicas[0].merge[0]  # type: ignore[index]
    arguments = [r.merge[1] for r in replicas]  # type: ignore[index]
    m_args, m_kwargs = regroup(arguments[0], arguments)
    with modes.push(modes.Mode(strategy, None, modes.MERGE)):
        result = merge_fn(strategy, *m_args, **m_kwargs)
    for i, replica in enumerate(replicas):
        replica.merged = nest.tree_map(lambda leaf, i=i: select(leaf, i), result)
        replica.merge = None
