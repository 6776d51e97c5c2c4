"""Save a checkpoint and stop when the job is about to end, as tf's ``PreemptionCheckpointHandler``.

Creating a :class:`PreemptionCheckpointHandler` restores the newest checkpoint (a requeued
job continues where it stopped) and starts watching for the end: ``SIGTERM`` or ``SIGUSR1``
(``#SBATCH --signal=USR1@120``) on any rank, the allocation's end minus
``TerminationConfig.grace_period`` under Slurm, or a ``termination_watcher_fn``. A signal
handler only sets a flag. The flag rides in the handshake every collective opens with
(``Allreduce(MAX)``), so at the next collective every rank knows, whichever rank saw it and
at no cost while nothing is pending. Every rank then finishes the same
:meth:`~PreemptionCheckpointHandler.run` call, the ranks save one checkpoint together before
the next (with a manager made with ``save_at_window_end=True``, after the calls that end a gradient
accumulation window it stopped in), and ``exit_fn`` runs: by default, under Slurm, rank 0 requeues the job
(``scontrol requeue``) and every rank exits with status 0; elsewhere every rank exits with
:data:`RESTART_EXIT_CODE` (75), which a wrapper script can loop on.

>>> import mpistrat, numpy as np, tempfile
>>> step = mpistrat.Variable(np.int64(0))
>>> handler = PreemptionCheckpointHandler(mpistrat.Checkpoint(step=step), tempfile.mkdtemp())
>>> for _ in range(3):
...     _ = handler.run(step.assign_add, 1)
>>> handler.total_run_calls, int(step.numpy())
(3, 3)
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from mpi4py import MPI

from mpistrat import nest
from mpistrat.checkpoint.checkpoint import Checkpoint
from mpistrat.checkpoint.manager import CheckpointManager
from mpistrat.diagnostics import ulfm, watchdog
from mpistrat.errors import InvalidArgumentError, PeerFailedError
from mpistrat.log import ANY_RANK, logger
from mpistrat.options import CheckpointOptions
from mpistrat.training.variables import plain_variable

__all__ = ["RESTART_EXIT_CODE", "PreemptionCheckpointHandler", "PreemptionWatcher", "TerminationConfig"]

RESTART_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"; the default exit outside Slurm
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
RUN_CALLS = "__preemption__/total_run_calls"  # the checkpoint entry holding total_run_calls
_WATCHER_POLL = 1.0  # seconds between calls of termination_watcher_fn, as tf's


@dataclasses.dataclass
class TerminationConfig:
    """How a :class:`PreemptionCheckpointHandler` learns of the end, saves, and exits (tf's fields).

    Args:
        termination_watcher_fn: called about once a second in a thread of its own; returning
            True asks to stop (as a signal does). It must not block, nor use MPI.
        exit_fn: called on every rank after the checkpoint is saved, instead of the default
            exit (Slurm: requeue and exit 0; elsewhere ``sys.exit(RESTART_EXIT_CODE)``).
        grace_period: seconds. Under Slurm, stop once the allocation has this many seconds
            left; None (the default) watches only signals and the watcher.
        save_fn: called on every rank instead of ``CheckpointManager.save()``.
    """

    termination_watcher_fn: Callable[[], bool] | None = None
    exit_fn: Callable[[], Any] | None = None
    grace_period: float | None = None
    save_fn: Callable[[], Any] | None = None


# Signal handlers only set flags, on the live handlers in this tuple (replaced whole, never mutated).
_watching: tuple[weakref.ref[Any], ...] = ()  # PreemptionCheckpointHandler and PreemptionWatcher
_previous: dict[int, Any] = {}


def _on_signal(signum: int, frame: Any) -> None:
    handlers = [h for ref in _watching if (h := ref()) is not None]
    for handler in handlers:
        handler._request(signal.Signals(signum).name)
    if not handlers:  # nothing watches any more: what would have happened without us
        previous = _previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _watch_signals(handler: PreemptionCheckpointHandler | PreemptionWatcher) -> None:
    global _watching
    _watching = (*(r for r in _watching if r() is not None), weakref.ref(handler))
    if _previous or threading.current_thread() is not threading.main_thread():
        return  # Python runs signal handlers in the main thread only; elsewhere the other triggers work
    for signum in SIGNALS:
        _previous[signum] = signal.signal(signum, _on_signal)


def _unwatch_signals() -> None:
    global _watching
    _watching = ()
    if threading.current_thread() is threading.main_thread():
        for signum, previous in _previous.items():
            signal.signal(signum, previous)
        _previous.clear()


class PreemptionCheckpointHandler:
    """Restore the newest checkpoint now; on a termination signal, save one and exit (collective).

    Args:
        checkpoint_or_manager: a :class:`CheckpointManager` (its saves go to its directory),
            or a :class:`Checkpoint` with ``checkpoint_dir`` (a manager keeping one file).
        checkpoint_dir: where a bare checkpoint is saved.
        termination_config: a :class:`TerminationConfig`.

    The checkpoint gains one entry, ``__preemption__/total_run_calls``, so
    :attr:`total_run_calls` comes back with it. Create it on every rank, in cross-replica
    context, after the checkpoint's variables (and optimizer slots) exist.
    """

    def __init__(
        self,
        checkpoint_or_manager: Checkpoint | CheckpointManager,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        termination_config: TerminationConfig | None = None,
    ):
        if isinstance(checkpoint_or_manager, CheckpointManager):
            manager = checkpoint_or_manager
        elif isinstance(checkpoint_or_manager, Checkpoint):
            if checkpoint_dir is None:
                raise InvalidArgumentError(
                    "PreemptionCheckpointHandler: with a Checkpoint, pass checkpoint_dir (where to save); "
                    "got None"
                )
            manager = CheckpointManager(checkpoint_or_manager, checkpoint_dir, max_to_keep=1)
        else:
            raise InvalidArgumentError(
                "PreemptionCheckpointHandler: expected an mpistrat.Checkpoint or CheckpointManager; "
                f"got {type(checkpoint_or_manager).__name__}"
            )
        config = TerminationConfig() if termination_config is None else termination_config
        if not isinstance(config, TerminationConfig):
            raise InvalidArgumentError(
                "PreemptionCheckpointHandler: termination_config must be a TerminationConfig; "
                f"got {type(config).__name__}"
            )
        checkpoint = manager.checkpoint
        self._manager, self._config = manager, config
        self._strategy = checkpoint.strategy("PreemptionCheckpointHandler")
        self._collectives = self._strategy.extended.collectives
        self._run_calls = plain_variable(np.zeros((), np.int64), RUN_CALLS)
        checkpoint.track(RUN_CALLS, self._run_calls)
        self._reasons: list[str] = []  # what this rank saw (filled by signal handlers and the watcher)
        self._reported = 0
        self._checked_at = -1  # handshakes seen at the last check
        self._window_said = False  # a stop waiting for an accumulation window's end was logged

        path = manager.latest_checkpoint
        if path is not None:
            self._run_calls.assign(np.int64(-1))  # stays -1 if the file holds no run count
            checkpoint.restore(path)
        counted = int(self._run_calls.numpy())
        self._total_run_calls = max(counted, 0)
        self._run_calls.assign(np.int64(self._total_run_calls))
        if path is not None and counted >= 0:
            logger.info(
                "PreemptionCheckpointHandler: restored %s; continuing after run call %d",
                path,
                self._total_run_calls,
            )
        elif path is not None:
            logger.info(
                "PreemptionCheckpointHandler: restored %s, saved without a run count (not by this "
                "handler): run calls count from 0",
                path,
            )
        self._deadline = self._allocation_deadline(config.grace_period)

        _watch_signals(self)
        logger.info(
            "PreemptionCheckpointHandler: watching for SIGTERM and SIGUSR1%s; saves go to %s",
            " and termination_watcher_fn" if config.termination_watcher_fn is not None else "",
            manager.directory,
        )
        if config.termination_watcher_fn is not None:
            threading.Thread(
                target=_poll_watcher,
                args=(weakref.ref(self), config.termination_watcher_fn),
                name="mpistrat-preemption-watcher",
                daemon=True,
            ).start()

    @property
    def total_run_calls(self) -> int:
        """How many :meth:`run` calls have completed, over every run of the job (restored on creation)."""
        return self._total_run_calls

    def run(self, distributed_train_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``distributed_train_function(*args, **kwargs)`` (one training step), unless the job stops.

        If a stop was agreed during earlier calls, every rank saves the checkpoint here and
        ``exit_fn`` runs instead (the default exits the process).

        Where the job survives a rank's death (Open MPI launched with ``--with-ft ulfm``), a call
        during which a rank died goes on with the survivors (``MPIStrategy.recover``) and returns
        None: if a survivor had completed its step, it counts; otherwise it is made again, with the
        batch a distributed iterator handed out read again and split over the survivors, and counts
        once; where no argument is such a batch (the loop took it apart first), it does not count,
        and the iterator hands that batch out again at the next read.
        """
        self._check_and_maybe_save()
        while True:
            applied = self._collectives.commits
            try:
                result = distributed_train_function(*args, **kwargs)
                break
            except PeerFailedError:
                recover = getattr(self._strategy, "recover", None)
                if recover is None or not ulfm.live():
                    raise
                if recover().step > applied:  # a survivor completed this call's step
                    result = None
                    break
                again = _renewed(self._collectives, (args, kwargs))
                if again is None:
                    return None
                args, kwargs = again
        self._total_run_calls += 1
        self._run_calls.assign(np.int64(self._total_run_calls))  # saved by every save, not only ours
        return result

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """As tf's: a scope for a loop that calls :meth:`save_checkpoint_if_preempted` itself.

        Signals are watched from the handler's creation on; the scope only marks the loop.
        """
        yield

    def save_checkpoint_if_preempted(self, *args: Any, **kwargs: Any) -> None:
        """Save and exit if a stop was agreed (collective: call it at the same point on every rank).

        For loops that do not use :meth:`run`; ``args`` and ``kwargs`` go to
        ``CheckpointManager.save`` (e.g. ``checkpoint_number``).
        """
        self._check_and_maybe_save(*args, **kwargs)

    # -- the agreement --------------------------------------------------------------------

    def _request(self, reason: str) -> None:
        """A trigger fired on this rank: set the flag the next handshake carries (signal-safe)."""
        self._reasons.append(reason)
        self._collectives.stop.request()

    def _check_and_maybe_save(self, *save_args: Any, **save_kwargs: Any) -> None:
        collectives = self._collectives
        if self._deadline is not None and not collectives.stop.requested and time.time() >= self._deadline:
            self._request(f"the allocation ends in {self._config.grace_period:g} s (grace_period)")
        if len(self._reasons) > self._reported:
            self._reported = len(self._reasons)
            logger.warning(
                "PreemptionCheckpointHandler: %s on this rank; stopping after the step every rank is in",
                self._reasons[-1],
                extra=ANY_RANK,
            )
        if not collectives.stop.agreed and collectives.handshakes == self._checked_at:
            # No handshake since the last check (the check is off, or a step without collectives):
            # one of its own, so a pending flag still reaches every rank.
            collectives.agree("preemption check", extras=[])
        self._checked_at = collectives.handshakes
        if collectives.stop.agreed:
            manager = self._manager
            if manager.save_at_window_end and (windows := manager.checkpoint.accumulating()):
                if not self._window_said:  # this call's step runs; the check comes again at the next
                    self._window_said = True
                    logger.warning(
                        "PreemptionCheckpointHandler: stopping at the end of the accumulation window "
                        "(optimizer %s; save_at_window_end)",
                        ", ".join(windows),
                    )
                return
            self._save_and_exit(save_args, save_kwargs)

    def _save_and_exit(self, save_args: tuple[Any, ...], save_kwargs: dict[str, Any]) -> None:
        logger.warning(
            "PreemptionCheckpointHandler: every rank stops after run call %d; saving a checkpoint",
            self._total_run_calls,
        )
        began = time.monotonic()
        if self._config.save_fn is not None:
            self._config.save_fn()
            logger.warning("PreemptionCheckpointHandler: saved (save_fn) in %.2f s", time.monotonic() - began)
        else:
            asked = save_kwargs.pop("options", None) or CheckpointOptions()
            # Synchronous whatever was asked: the process exits next, so the file must be in place.
            save_kwargs["options"] = dataclasses.replace(
                asked, enable_async=False, experimental_enable_async_checkpoint=False
            )
            path = self._manager.save(*save_args, **save_kwargs)
            logger.warning(
                "PreemptionCheckpointHandler: saved %s in %.2f s (%.1f MiB)",
                path,
                time.monotonic() - began,
                os.path.getsize(path) / 2**20,
            )
        self._collectives.stop.clear()
        _unwatch_signals()  # saved: from here on a SIGTERM (Slurm ending the job) ends the process
        if self._config.exit_fn is not None:
            self._config.exit_fn()
        else:
            self._default_exit()

    def _default_exit(self) -> None:
        job = os.environ.get("SLURM_JOB_ID")
        if job:
            # Requeueing ends this run of the job: rank 0 does it once every rank has finished
            # (after MPI_Finalize), so no rank is killed mid-exit.
            if self._collectives.rank == 0:
                atexit.register(_requeue_at_exit, job)
            logger.warning("PreemptionCheckpointHandler: exiting; rank 0 then requeues Slurm job %s", job)
            sys.exit(0)
        logger.warning(
            "PreemptionCheckpointHandler: exiting with status %d: run the job again to continue",
            RESTART_EXIT_CODE,
        )
        sys.exit(RESTART_EXIT_CODE)

    # -- the triggers besides signals ---------------------------------------------------------

    def _allocation_deadline(self, grace_period: float | None) -> float | None:
        """When to stop (seconds since the epoch): the Slurm job's end minus ``grace_period`` (collective)."""
        if grace_period is None:
            return None
        if isinstance(grace_period, bool) or not isinstance(grace_period, (int, float)) or grace_period < 0:
            raise InvalidArgumentError(
                f"TerminationConfig: grace_period must be a number of seconds >= 0; got {grace_period!r}"
            )
        end = self._collectives.on_root(_slurm_end_time, kind="preemption (job end time)")
        if end is None:
            return None
        logger.info(
            "PreemptionCheckpointHandler: the allocation ends at %s; stopping %g s before",
            datetime.datetime.fromtimestamp(end).isoformat(timespec="seconds"),
            grace_period,
        )
        return end - float(grace_period)


class PreemptionWatcher:
    """Watch for a termination signal and say when every rank knows of it, as tf's
    ``tf.distribute.experimental.PreemptionWatcher``.

    On the same path as :class:`PreemptionCheckpointHandler`: ``SIGTERM`` or ``SIGUSR1`` on
    any rank sets a flag that the handshake of the next collective of the current strategy
    carries to every rank; from then on :attr:`preemption_message` is a string on every rank
    (None before). Reading it never communicates. It neither saves nor exits: that is the
    handler's job, and a program may use both. Create it on every rank, inside the
    strategy's scope (or outside any, for the single-replica default strategy).

    >>> watcher = PreemptionWatcher()
    >>> watcher.preemption_message is None
    True
    """

    def __init__(self) -> None:
        from mpistrat.interface import modes  # the strategy layer imports this module

        self._collectives = modes.get_strategy().extended.collectives
        self._reasons: list[str] = []
        self._message: str | None = None
        _watch_signals(self)

    def _request(self, reason: str) -> None:
        """A signal on this rank (called from the signal handler: only sets flags)."""
        self._reasons.append(reason)
        self._collectives.stop.request()

    @property
    def preemption_message(self) -> str | None:
        """None until a termination signal has been agreed by every rank; then what was seen."""
        if self._message is None and self._collectives.stop.agreed:
            seen = (
                f"{self._reasons[-1]} on rank {self._collectives.rank}"
                if self._reasons
                else "on another rank"
            )
            self._message = f"preemption: a termination signal was received ({seen})"
        return self._message

    def block_until_worker_exit(self) -> None:
        """Nothing to wait for on MPI (tf's is a no-op outside TPU clusters too)."""


def _renewed(collectives: Any, arguments: Any) -> Any:
    """``arguments`` with the batch a distributed iterator of the strategy handed out last read again
    from it (moved back by the recovery: the same global batch, split over the survivors), leaf by
    leaf; None where no argument holds any of that batch."""
    held = {id(leaf) for leaf in nest.flatten(arguments) if leaf is not None}
    found: dict[int, Any] = {}
    for _, obj in collectives.recoverables.items():
        renewed = getattr(obj, "renewed", None)
        if renewed is not None:
            found.update(renewed(held) or {})
    if not found:
        return None
    return nest.map_structure(lambda leaf: found.get(id(leaf), leaf), arguments)


def _poll_watcher(handler: weakref.ref[PreemptionCheckpointHandler], watcher: Callable[[], bool]) -> None:
    """Call ``watcher`` every ``_WATCHER_POLL`` seconds until it returns True or the handler is gone."""
    while True:
        time.sleep(_WATCHER_POLL)
        if handler() is None:
            return
        if watcher():
            live = handler()
            if live is not None:
                live._request("termination_watcher_fn returned True")
            return


def _slurm_end_time() -> float | None:
    """The Slurm job's end time (seconds since the epoch), or None outside Slurm or with no limit."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    given = os.environ.get("SLURM_JOB_END_TIME", "").strip()  # set by Slurm 23.02 and later
    if given.isdigit():
        return float(given)
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
        return datetime.datetime.fromisoformat(out).timestamp()  # local time, as squeue prints it
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        logger.warning(
            "PreemptionCheckpointHandler: cannot read job %s's end time (%s); grace_period is ignored",
            job,
            exc,
        )
        return None


def _requeue_at_exit(job: str) -> None:
    """At rank 0's exit: stop the watchdog, finalize MPI (every rank has finished), requeue."""
    watchdog.WATCHDOG.shutdown()  # as at any exit: say this rank leaves, stop the thread, before MPI_Finalize
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    try:
        subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = str(getattr(exc, "stderr", None) or exc).strip()
        logger.error("PreemptionCheckpointHandler: scontrol requeue %s failed: %s", job, detail)
        sys.stderr.flush()
        os._exit(RESTART_EXIT_CODE)
    logger.warning("PreemptionCheckpointHandler: requeued Slurm job %s", job)
