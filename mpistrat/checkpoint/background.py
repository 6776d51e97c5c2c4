"""Background saves (``CheckpointOptions(enable_async=True)``): written while training goes on.

:func:`start` copies this rank's share aside (the values of the moment of the call) and hands
it to a thread that writes it with POSIX calls at a lower priority, then checksums it. MPI-IO
is not used there: an MPI-IO call holds the MPI library's lock (MPICH's global critical
section) for the whole transfer, and the training step's collectives in the main thread would
wait for it. :func:`wait_for_saves` (the next checkpoint call, ``sync()``, a strategy's
finalize, or the end of the job) joins the thread and finishes the save on every rank
(:func:`mpistrat.checkpoint.saving.finish`), raising a failure on every rank there.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from mpistrat.checkpoint import mpiio
from mpistrat.checkpoint.saving import ALWAYS, Save, checksums, close, finish
from mpistrat.log import logger

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["start", "wait_for_saves", "writing"]

# A background writer's niceness (Linux, this thread only): the training step keeps its CPU.
WRITER_NICENESS = 10


_pending: list[tuple[Save, Collectives, Callable[[], None]]] = []
_exit_hook = False
# The last staging buffer, kept for the next background save: a fresh one page-faults on every
# byte it is copied into (0.23 s for 100 MiB here, longer than writing it to the page cache).
# The peak is unchanged (a background save holds a staged share anyway); between saves the rank
# keeps one share more.
_staging: np.ndarray | None = None


def start(save: Save, collectives: Collectives, on_success: Callable[[], None]) -> None:
    """Copy this rank's pieces aside and write them in a thread; :func:`wait_for_saves` (or the
    end of the job) finishes the save, then runs ``on_success`` on every rank."""
    global _exit_hook
    close(save)  # collective; the thread writes with POSIX calls
    total = sum(p.nbytes for call in save.calls for p in call)
    staged = _staging_buffer(total)  # the share at this moment: training may change the arrays
    at, copied = 0, []
    for call in save.calls:
        pieces = []
        for p in call:
            staged[at : at + p.nbytes] = p.memory
            pieces.append(dataclasses.replace(p, memory=staged[at : at + p.nbytes]))
            at += p.nbytes
        copied.append(pieces)
    save.calls, save.keep = copied, [staged]
    header = save.header if collectives.rank == 0 else b""
    save.thread = threading.Thread(
        target=_drain, args=(save, header), name="mpistrat-checkpoint", daemon=True
    )
    save.thread.start()
    _pending.append((save, collectives, on_success))
    collectives.pending["checkpoint saves"] = functools.partial(wait_for_saves, collectives)
    if not _exit_hook:  # registered after MPI's own: runs before MPI is finalized (atexit is LIFO)
        atexit.register(_finish_at_exit)
        _exit_hook = True


def _staging_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` bytes to stage a share in: the last save's buffer when no writer still reads it."""
    global _staging
    if _staging is None or _staging.nbytes < nbytes or writing():
        _staging = np.empty(nbytes, np.uint8)
    return _staging[:nbytes]


def _drain(save: Save, header: bytes) -> None:
    """The background writer: POSIX writes of this rank's pieces, their checksums, fsync."""
    if sys.platform.startswith("linux"):  # a thread's own niceness: Linux only (elsewhere the process's)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
    try:
        mpiio.posix_write(save.tmp, header, save.calls)
        save.crcs = checksums(save.calls)
    except OSError as exc:
        save.error = mpiio.os_error(exc, "writing the checkpoint file", save.tmp)
    except BaseException as exc:  # whatever it is, every rank must hear of it at the wait
        save.error = mpiio.os_error(exc, "writing the checkpoint file", save.tmp)


def writing() -> bool:
    """Whether a background save is still writing on this rank (its thread has not finished)."""
    return any(save.thread is not None and save.thread.is_alive() for save, _, _ in _pending)


def wait_for_saves(collectives: Collectives) -> None:
    """Finish every background save over ``collectives`` (collective); raise the first failure.

    The ranks agree first, so they forget their pending saves together: a rank that called this
    alone (the others in another collective) fails with them and keeps its saves for the next call.
    """
    mine = [p for p in _pending if p[1] is collectives]
    if not mine:
        return
    collectives.agree(
        "checkpoint (background saves)",
        fingerprint=len(mine),
        describe=lambda: {"leaves": [("background saves", f"{len(mine)} pending", None)]},
        options=ALWAYS,
    )
    failure: BaseException | None = None
    for item in mine:
        _pending.remove(item)
        save, _, on_success = item
        try:
            finish(save, collectives)
        except BaseException as exc:
            failure = failure or exc
            continue
        logger.info(
            "Checkpoint.%s: %s written in the background (%.1f MiB, %.2f s)",
            save.method,
            save.path,
            save.nbytes / 2**20,
            time.monotonic() - save.began,
        )
        on_success()
    if failure is not None:
        raise failure


def _finish_at_exit() -> None:
    """At the end of the job: finish what is still being written (every rank is here)."""
    for collectives in list({id(c): c for _, c, _ in _pending}.values()):
        if MPI.Is_finalized() or collectives.freed:
            logger.error("Checkpoint: a background save could not finish: MPI is finalized")
            continue
        try:
            wait_for_saves(collectives)
        except BaseException as exc:
            logger.error("Checkpoint: a background save failed at exit: %s", exc)
