"""End the whole MPI job when one rank fails, instead of leaving the others waiting.

An uncaught exception on one rank would otherwise end that process only, and the
other ranks would wait in their next collective until the wall-clock limit. The
hook installed by :func:`install` (when an ``MPIStrategy`` is created) prints the
traceback with every line prefixed by the rank, then calls ``MPI_Abort``, so
``mpiexec``/``srun`` exit non-zero at once. It covers ``threading`` too. A ``KeyboardInterrupt``
(Ctrl-C, which the launcher passes to every rank) prints one line per rank, where it stopped,
and ends the job with status 130, as a shell reports SIGINT. Turn it off
with ``MPISTRAT_ABORT_ON_EXCEPTION=0`` or :func:`set_abort_on_exception`.

>>> set_abort_on_exception(True)
>>> enabled()
True
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from mpi4py import MPI

from mpistrat import config
from mpistrat.diagnostics import callsite
from mpistrat.errors import PEER_FAILED_EXIT, CollectiveTimeoutError, PeerFailedError
from mpistrat.log import world_rank

__all__ = [
    "abort_job",
    "abort_later",
    "add_last_words",
    "enabled",
    "install",
    "run_at_exit",
    "set_abort_on_exception",
]

_enabled: bool | None = None  # None: the environment decides
INTERRUPTED = 130  # a shell's status for a program ended by SIGINT (128 + 2)
# mpiexec/srun forward output through their own processes; MPI_Abort can kill those before
# the traceback printed just before it arrives, so it waits this long first.
_FORWARD_SECONDS = 0.5
_installed = False
_previous_hook: Any = None
_previous_thread_hook: Any = None
_doomed: tuple[str, int] | None = None  # a message and status the job must end with
_last_words: list[Any] = []  # callables returning text to print before an uncaught exception aborts
_exit_hooks: list[Callable[[], None]] = []  # run_at_exit's, the last added first


def add_last_words(say: Any) -> None:
    """Have ``say()`` (returning text, or "") printed with the rank when an uncaught exception aborts."""
    if say not in _last_words:
        _last_words.append(say)


def _say_last_words(exc: BaseException | None) -> None:
    if isinstance(exc, CollectiveTimeoutError):  # its diagnosis has every rank's records already
        return
    prefix = f"[rank {world_rank()}] "
    for say in _last_words:
        try:
            text = say()
        except Exception:  # last words must never stop the abort
            continue
        if text:
            _write("".join(prefix + line for line in text.splitlines(True)) + "\n")


def set_abort_on_exception(enabled: bool) -> None:
    """Turn on/off aborting the MPI job on an uncaught exception (overrides the environment)."""
    global _enabled
    _enabled = bool(enabled)


def enabled() -> bool:
    """Whether an uncaught exception aborts the job: the setting, else ``MPISTRAT_ABORT_ON_EXCEPTION``."""
    if _enabled is not None:
        return _enabled
    return bool(config.read("MPISTRAT_ABORT_ON_EXCEPTION"))


def _in_parallel_job() -> bool:
    try:
        return MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1
    except Exception:
        return False


def install() -> None:
    """Install the hooks (idempotent); they decide at call time whether to abort."""
    global _installed, _previous_hook, _previous_thread_hook
    if _installed:
        return
    _installed = True
    _previous_hook, sys.excepthook = sys.excepthook, _excepthook
    _previous_thread_hook, threading.excepthook = threading.excepthook, _thread_excepthook


def _write(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:
        pass


def _print_with_rank(exc_type: type[BaseException], exc: BaseException, tb: Any, where: str = "") -> None:
    prefix = f"[rank {world_rank()}] "
    lines = traceback.format_exception(exc_type, exc, tb)
    text = "".join(lines)
    _write((prefix + where if where else "") + "".join(prefix + line for line in text.splitlines(True)))


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    if not (enabled() and _in_parallel_job()):
        (_previous_hook or sys.__excepthook__)(exc_type, exc, tb)
        return
    if issubclass(exc_type, KeyboardInterrupt):  # Ctrl-C reaches every rank: no traceback, a shell's status
        where = callsite.traceback_site(tb)
        _write(f"[rank {world_rank()}] mpistrat: interrupted at {where}; calling MPI_Abort to end the job\n")
        _end(INTERRUPTED)
    if _previous_hook in (None, sys.__excepthook__):
        _print_with_rank(exc_type, exc, tb)
    else:
        try:
            _previous_hook(exc_type, exc, tb)  # someone else's hook (a debugger, a logger) goes first
        except BaseException:
            _print_with_rank(exc_type, exc, tb)
    _say_last_words(exc)
    # A rank's death that no survivor recovered from ends the job with its own status (relaunched by
    # jobs/train.sbatch); anything else with 1.
    code = PEER_FAILED_EXIT if isinstance(exc, PeerFailedError) else 1
    abort_job(
        f"uncaught {exc_type.__name__} (MPISTRAT_ABORT_ON_EXCEPTION=0 leaves the other ranks running)", code
    )


def _thread_excepthook(args: Any) -> None:
    if args.exc_type is SystemExit or not (enabled() and _in_parallel_job()):
        (_previous_thread_hook or threading.__excepthook__)(args)
        return
    name = args.thread.name if args.thread is not None else "a thread"
    _print_with_rank(args.exc_type, args.exc_value, args.exc_traceback, f"Exception in thread {name}:\n")
    _say_last_words(args.exc_value)
    abort_job(f"uncaught {args.exc_type.__name__} in thread {name}")


def abort_job(message: str, code: int = 1) -> NoReturn:
    """Print ``message`` with the rank, then end every process of the job (``MPI_Abort``)."""
    prefix = f"[rank {world_rank()}] mpistrat:"
    _write(f"{prefix} {message}\n{prefix} calling MPI_Abort to end the job\n")
    _end(code)


def _end(code: int) -> NoReturn:
    """``MPI_Abort(code)``: every process of the job ends, and the launcher with ``code``."""
    time.sleep(_FORWARD_SECONDS)  # let the launcher forward what was just printed before it is killed
    try:
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(code)
    finally:
        os._exit(code)


def abort_later(seconds: float, message: str, code: int = 1) -> None:
    """Abort the job after ``seconds`` (or at once if the program exits first): it cannot go on.

    Used after a collective timed out: the exception reaches the caller, who may catch
    it to clean up, but the communicator is left mid-operation, so the job must end.
    """
    global _doomed
    if _doomed is not None:
        return
    _doomed = message, code
    timer = threading.Timer(seconds, abort_job, args=(message, code))
    timer.daemon = True
    timer.start()


def run_at_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` at exit after the exit handlers the program registers after ``import mpistrat``
    (this module is imported with mpistrat, and registers its own handler then; atexit is LIFO),
    whenever the module that adds it is imported. The last added runs first, as with ``atexit``."""
    _exit_hooks.append(hook)


def _at_exit() -> None:
    while _exit_hooks:
        try:
            _exit_hooks.pop()()
        except Exception:  # as atexit does: say so, and run the rest
            _write(
                f"[rank {world_rank()}] Exception ignored in mpistrat's exit hook:\n{traceback.format_exc()}"
            )
    if _doomed is not None:
        abort_job(*_doomed)


# Registered at import (with mpistrat), so it runs after the program's exit handlers (atexit is LIFO):
# an error raised in one of them ("Exception ignored in atexit callback") still ends the job non-zero.
atexit.register(_at_exit)
