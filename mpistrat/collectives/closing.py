"""A step's closing: the one handshake ``strategy.run`` ends a step with while the check is on.

It carries the code of the step's result (its structure) and, from one rank, that rank's error,
so every rank raises when one did. Under ``MPISTRAT_CHECK=step`` it also checks what the step
left unchecked (:mod:`.step_check`), and a closing that passed ends the first step's checking
call by call. A later step that left nothing unchecked (on every rank alike: the last handshake
cleared every rank's record) sends nothing: its closing is numbered and marked finished as one
that sent. Whatever comes of it, the straggler tally forgets it: who arrives last at a step's end
says nothing new (the step's collectives did).

>>> from mpi4py import MPI
>>> from mpistrat import CommunicationOptions
>>> from mpistrat.collectives import Collectives
>>> ones = Collectives(MPI.COMM_SELF.Dup(), CommunicationOptions(check="step"))  # one rank: learned
>>> ones.all_reduce("sum", 1.0); close_step(ones, "step", lambda: 7, lambda: None); ones.handshakes
np.float64(1.0)
2
>>> close_step(ones, "step", lambda: 7, lambda: None); ones.handshakes, ones.monitor.last[:2]
(2, ('step', 3))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from mpistrat.collectives import handshake
from mpistrat.collectives.fingerprint import cached_code
from mpistrat.diagnostics import monitor as monitoring
from mpistrat.diagnostics import stragglers, timeline, watchdog

if TYPE_CHECKING:
    from mpistrat.collectives.native_step import Closing
    from mpistrat.collectives.state import CollectiveState

__all__ = ["close_step"]


def close_step(
    self: CollectiveState,
    kind: str,
    fingerprint: Callable[[], int],
    describe: Callable[[], Any],
    error: BaseException | None = None,
) -> None:
    """Close a step with handshake ``kind`` (the check on): ``fingerprint()`` is this rank's code of
    the step's result, asked for only when the closing sends; ``describe`` says what it was, when
    the ranks' differ; ``error`` this rank's own, raised on every rank (where nothing is sent, on
    this rank alone, as every unchecked collective's)."""
    step = self.step_check
    learned = step is not None and not step.learning  # under MPISTRAT_CHECK=step, after the first step
    if step is not None and learned and not step.record:  # nothing unchecked, on any rank: nothing sent
        self.seq += 1
        self.monitor.leave(kind, self.seq, completed=True)
        self.stragglers.forget()
        if error is not None:
            raise error
        return
    code = fingerprint()
    try:
        if learned and error is None and _compiled(self, kind, code, describe):
            return
        _handshake(self, kind, code, describe, error)
        if step is not None:
            step.learned()
    finally:
        self.stragglers.forget()


@watchdog.collective("step closing")
def _handshake(
    self: CollectiveState,
    kind: str,
    fingerprint: int,
    describe: Callable[[], Any],
    error: BaseException | None,
) -> None:
    """The closing's handshake, watched as every collective (its own: ``strategy.run`` is in none)."""
    self.seq += 1
    handshake.exchange(self, kind, fingerprint, describe, error, 0)


def _compiled(self: CollectiveState, kind: str, fingerprint: int, describe: Callable[[], Any]) -> bool:
    """A learned step's closing, compiled (``native_step.Closing``, its common case: no poll, no
    timeline, no collective under way) where the step check runs its compiled twin; False (nothing
    done) where :func:`_handshake` must run."""
    closing = self.native_closing
    if closing is None:
        closing = self.native_closing = _native_closing(self, kind)
    if (
        not closing
        or timeline.writer is not None
        or (monitoring.exited and self.monitor.env_timeout is not None)
    ):
        return False  # no compiled closing, or a timeline to write, or a watch that polls after the exit hook
    busy = self.monitor.busy
    if not busy.acquire(False):
        return False  # another collective is under way: the watch says what to do
    self.seq += 1  # before the wait: a stall warning or a disagreement names the closing by it
    try:
        closed = closing.close(
            self, kind, self.seq, fingerprint, describe, self.stop.requested, self.stragglers.outgoing
        )
    except MPI.Exception as exc:  # as the watch of every other collective counts and turns it
        self.failures += 1
        raise self.failed_in_mpi(exc, kind) from exc
    except BaseException:
        self.failures += 1
        raise
    finally:
        busy.release()
    if not closed:
        self.seq -= 1  # nothing done: the watched handshake numbers it
    return closed


def _native_closing(self: CollectiveState, kind: str) -> Closing | bool:
    """The compiled closing of ``kind`` for these collectives, or False where the closing runs in
    Python: the step check's Python twin, no persistent handshake, or a watch that polls (a timeout
    chosen in the options, or set in the environment and not ``off``). It writes the monitor's
    marks (compiled: ``step_check.CompiledMonitor``) and the step check's record, and calls what it
    is handed here."""
    step = self.step_check
    if step is None:  # the compiled closing runs with the step check's compiled twin alone
        return False
    from mpistrat.collectives import step_check  # loaded already: it made ``step``

    send, recv, request, _, stop = self.handshake_buffers
    monitor = self.monitor
    compiled = step_check.native_step
    if (
        compiled is None
        or step_check.CompiledStepCheck is None
        or not isinstance(step, step_check.CompiledStepCheck)
        or step_check.CompiledMonitor is None
        or not isinstance(monitor, step_check.CompiledMonitor)
        or not isinstance(request, MPI.Prequest)
        or self.options.timeout_seconds is not None
        or (monitor.env_polled and monitor.env_timeout is not None)
    ):
        return False
    return compiled.Closing(
        marks=monitor,
        step=step,
        append=self.flight.append,
        start=request.Start,
        wait=request.Wait,
        file=self.stragglers.file,
        reached=stop.reached,
        disagreed=handshake.disagreed,
        send=send,
        recv=recv,
        kind=kind,
        kind_code=cached_code(self.caches.codes, kind, kind.__str__),
        magic=handshake.MAGIC_NUMBER,
        timeout=monitor.env_timeout,
        nothing=stragglers.NOTHING,
        mask=step_check.MASK,
    )
