"""What a collective reads and writes of the object it is a method of: one ``Collectives``'s
shared state, as a protocol the op files are typed against.

Each op file defines its collective as a function of ``self`` and ``Collectives``
(``collectives/__init__.py``) assigns it as a method. The op files type ``self`` with this
protocol (``self: CollectiveState``), so they never import the class that imports them. Besides
the state, the protocol names the two calls one collective makes of another: ``agree`` (the
handshake every collective opens with) and ``all_reduce``.

>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> isinstance(Collectives(MPI.COMM_SELF.Dup()), CollectiveState)
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.caches import Caches
from mpistrat.collectives.step_check import StepCheck
from mpistrat.collectives.stop import StopState
from mpistrat.collectives.sum_modes import SumMode
from mpistrat.comm.transport import Transports
from mpistrat.diagnostics.flight import Flight
from mpistrat.diagnostics.monitor import Monitor
from mpistrat.diagnostics.stragglers import Tally
from mpistrat.errors import MpistratError
from mpistrat.options import CommunicationOptions

__all__ = ["CollectiveState"]


@runtime_checkable
class CollectiveState(Protocol):
    """One ``Collectives``'s state: its communicator, options, caches, transports, counters and
    the watchdog's monitor (see ``Collectives.__init__`` for what each holds)."""

    comm: MPI.Intracomm
    rank: int
    size: int
    options: CommunicationOptions
    sum_mode: SumMode  # how float sums travel by default
    check: int  # the check level: 0 off, 1 the handshake (also under MPISTRAT_CHECK=step), 2 strict
    step_check: StepCheck | None  # MPISTRAT_CHECK=step's record of unchecked collectives
    seq: int
    disagreements: int
    failures: int
    caches: Caches
    transports: Transports
    stragglers: Tally
    flight: Flight
    monitor: Monitor
    stop: StopState
    # The handshake's reused send and receive buffers, its persistent collective (or None), the
    # buffers as MPI messages, and the stop state.
    handshake_buffers: tuple[np.ndarray, np.ndarray, Any, tuple[list[Any], list[Any]], StopState]
    pending: dict[str, Callable[[], None]]
    after_step: dict[str, Callable[[], None]]
    requests: list[MPI.Prequest]  # MPI requests freed with the communicator
    native_closing: Any  # the compiled closing (closing.py), False: none, None: not yet made

    @property
    def handshakes(self) -> int: ...

    def agree(
        self,
        kind: str,
        *,
        fingerprint: int = 0,
        describe: Callable[[], Any] | None = None,
        error: BaseException | None = None,
        extras: list[int] | None = None,
        maximum: int | None = None,
        options: CommunicationOptions | None = None,
        deferrable: bool = False,
    ) -> Any: ...

    def failed_in_mpi(self, exc: MPI.Exception, kind: str) -> MpistratError: ...

    def all_reduce(
        self,
        reduce_op: Any,
        value: Any,
        options: CommunicationOptions | None = None,
        *,
        kind: str = "all_reduce",
        error: MpistratError | None = None,
    ) -> Any: ...
