"""Background saves (``CheckpointOptions(enable_async=True)``): written while training goes on, put in
place as soon as every rank's share is written.

A save copies this rank's share aside (the values of the moment of the call) and hands it to a
thread that writes it with POSIX calls at a lower priority, then checksums it. The thread uses no
MPI: an MPI-IO call holds the MPI library's lock (MPICH's global critical section) for the whole
transfer, and the training step's collectives in the main thread would wait for it.

The file is put in place (:func:`mpistrat.checkpoint.saving.finish`: the checksums to rank 0,
which completes the header and renames the file) on every rank at the same point, the first of:

- the end of a ``strategy.run`` step after which every rank's share is written. While a save is
  pending, each step ends with one small agreement (one handshake: ``Allreduce(MAX)`` of whether
  this rank's writer is still busy); the step after which no rank's is, finishes the save. No
  message is added to a step while no save is pending;
- the next checkpoint call, ``sync()``, the strategy's finalize, or the end of the job, which
  wait for the writers.

A save that fails is raised on every rank at the next checkpoint call or ``sync()`` (a failure
found at the end of a step is logged there and kept for it), never out of the training step.

A rank's death (``PeerFailedError``, where it can be survived) abandons the saves in flight: their
temporary files are removed, never put in place, so the previous checkpoint stays the latest. The
recovery does it (``Collectives.abandon``) when the death came elsewhere; a death during a step's
agreement or the finish raises out of that step (which every survivor applied) to the recovery.

All of a strategy's background saves in flight on this rank are one :class:`BackgroundSaves` (its
saves, each with its writer's thread, and a kept failure); all of this process's, with the staging
buffer they reuse and the exit hook, one :class:`Background`, :data:`BACKGROUND`, whose ``start``
and ``wait`` are this module's :func:`start` and :func:`wait_for_saves`.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from mpistrat.checkpoint import crc, local_copies, mpiio
from mpistrat.checkpoint.crc import records
from mpistrat.checkpoint.saving import ALWAYS, Save, close, finish
from mpistrat.errors import PeerFailedError
from mpistrat.log import logger

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["BACKGROUND", "Background", "BackgroundSaves", "start", "wait_for_saves"]

# A background writer's niceness (Linux, this thread only): the training step keeps its CPU.
WRITER_NICENESS = 10
# What a step's end agrees on while a save is pending (the name in a mismatch or a stall warning).
POLL = "checkpoint (background save written?)"
WORK = "checkpoint saves"  # their work's name in Collectives.pending, .after_step and .abandon


class BackgroundSaves:
    """The background saves over one strategy's collectives that this rank has started and not yet
    finished, and a failure found at the end of a step, kept for the next checkpoint call.

    Every rank holds the same saves in the same order (a save is collective), so each decision
    below is taken on every rank alike. States: a save is *written* on a rank once its writer's
    thread ended; it is *in place* once :meth:`finish` ran (collective), and then leaves
    :attr:`saves`.
    """

    def __init__(self, collectives: Collectives):
        self.collectives = collectives
        self.saves: list[Save] = []  # each with its writer's thread
        self.failure: BaseException | None = None  # from a finish at a step's end, raised at the next call

    def start(self, save: Save, staging: np.ndarray) -> None:
        """Copy this rank's pieces into ``staging`` and write them in a thread."""
        close(save)  # collective; the thread writes with POSIX calls
        _stage(save, staging)
        header = save.header if self.collectives.rank == 0 else b""
        save.thread = threading.Thread(
            target=_drain, args=(save, header), name="mpistrat-checkpoint", daemon=True
        )
        save.thread.start()
        self.saves.append(save)
        self.collectives.pending[WORK] = self.wait
        self.collectives.after_step[WORK] = self.poll
        self.collectives.abandon[WORK] = self.abandon

    def busy(self) -> bool:
        """Whether a writer of this rank is still writing."""
        return any(save.thread is not None and save.thread.is_alive() for save in self.saves)

    def poll(self) -> None:
        """At the end of a step (collective): put the saves in place if every rank's share is written.
        One handshake; a failure is logged and kept for the next checkpoint call."""
        if self.collectives.agree(POLL, maximum=int(self.busy()), options=ALWAYS):
            return  # some rank still writes: the next step asks again
        try:
            self.finish()
        except PeerFailedError:  # a rank died: the survivors recover (the saves are abandoned)
            raise
        except Exception as exc:  # every rank alike: raised at the next checkpoint call, not out of the step
            self.failure = exc
            logger.warning("Checkpoint: a background save failed (the next checkpoint call raises): %s", exc)

    def finish(self) -> None:
        """Finish every save (collective): wait for its writer, put it in place (rank 0 completes
        the header and renames the file), run its ``in_place``; raise the first failure."""
        self._unregister()
        failure: BaseException | None = None
        while self.saves:
            save = self.saves.pop(0)
            try:
                seconds = finish(save, self.collectives)
            except PeerFailedError:  # a rank died: none of them lands
                self.saves.insert(0, save)
                self.abandon()
                raise
            except BaseException as exc:
                failure = failure or exc
                continue
            logger.info(
                "Checkpoint.%s: %s in place (%.1f MiB written in the background in %.2f s)",
                save.method,
                save.path,
                save.nbytes / 2**20,
                seconds or 0.0,
            )
            save.in_place()
            local_copies.keep(save, self.collectives)
        if failure is not None:
            raise failure

    def wait(self) -> None:
        """Finish every save (collective), and raise a failure kept from a step's end or found now.

        The ranks agree first, so they forget their saves together: a rank that called this alone
        (the others in another collective) fails with them and keeps its saves for the next call.
        """
        if not self.saves and self.failure is None:
            return
        self.collectives.agree(
            "checkpoint (background saves)",
            fingerprint=len(self.saves),
            describe=lambda: {"leaves": [("background saves", f"{len(self.saves)} pending", None)]},
            options=ALWAYS,
        )
        kept, self.failure = self.failure, None
        if self.saves:
            self.finish()
        if kept is not None:
            raise kept

    def abandon(self) -> None:
        """Drop every save: a rank died, the communicator is lost (local, no communication). Their
        temporary files are removed, never put in place, so the previous checkpoint stays the latest;
        a writer still running ends on its own."""
        self._unregister()
        self.failure = None
        while self.saves:
            save = self.saves.pop(0)
            with contextlib.suppress(OSError):
                os.remove(save.tmp)
            logger.warning(
                "Checkpoint.%s: the background save of %s is abandoned (a rank died); the previous "
                "checkpoint stays the latest",
                save.method,
                save.path,
            )

    def _unregister(self) -> None:
        for work in (self.collectives.after_step, self.collectives.pending, self.collectives.abandon):
            work.pop(WORK, None)


class Background:
    """All of this process's background saves: each strategy's (a :class:`BackgroundSaves`, by its
    collectives: kept while a save is in flight or a failure is kept), the staging buffer a save
    reuses, and whether the exit hook that finishes them is registered. One per process
    (:data:`BACKGROUND`)."""

    def __init__(self) -> None:
        self.strategies: dict[int, BackgroundSaves] = {}
        # The last staging buffer, kept for the next background save: a fresh one page-faults on every
        # byte it is copied into (0.23 s for 100 MiB here, longer than writing it to the page cache).
        # The peak is unchanged (a background save holds a staged share anyway); between saves the
        # rank keeps one share more.
        self.staging: np.ndarray | None = None
        self.exit_hook = False

    def start(self, save: Save, collectives: Collectives) -> None:
        """Copy this rank's pieces aside and write them in a thread; the file is put in place at the
        end of the first step after which every rank's share is written, or by the next checkpoint
        call (or the end of the job), which then runs its ``in_place`` on every rank."""
        saves = self.strategies.get(id(collectives))
        if saves is None:
            saves = self.strategies[id(collectives)] = BackgroundSaves(collectives)
        saves.start(save, self._staging_buffer(sum(p.nbytes for call in save.calls for p in call)))
        if not self.exit_hook:  # registered after MPI's own: runs before MPI is finalized (atexit is LIFO)
            atexit.register(self.finish_at_exit)
            self.exit_hook = True

    def wait(self, collectives: Collectives) -> None:
        """Finish every background save over ``collectives`` (collective); raise the first failure.
        Called on one rank alone, it fails on every rank, and each keeps its saves."""
        saves = self.strategies.get(id(collectives))
        if saves is not None:
            saves.wait()
            del self.strategies[id(collectives)]

    def writing(self) -> bool:
        """Whether a background save is still being written on this rank (its thread has not ended)."""
        return any(saves.busy() for saves in list(self.strategies.values()))

    def _staging_buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes to stage a share in: the last save's buffer when no writer still reads it."""
        if self.staging is None or self.staging.nbytes < nbytes or self.writing():
            self.staging = np.empty(nbytes, np.uint8)
        return self.staging[:nbytes]

    def finish_at_exit(self) -> None:
        """At the end of the job: finish what is still being written (every rank is here)."""
        while self.strategies:
            saves = self.strategies.popitem()[1]
            if not saves.saves:  # a failure kept from a step's end was logged there
                continue
            if MPI.Is_finalized() or saves.collectives.freed:
                logger.error("Checkpoint: a background save could not finish: MPI is finalized")
                continue
            try:
                saves.finish()
            except BaseException as exc:
                logger.error("Checkpoint: a background save failed at exit: %s", exc)


BACKGROUND = Background()  # this process's
start = BACKGROUND.start
wait_for_saves = BACKGROUND.wait


def _stage(save: Save, staged: np.ndarray) -> None:
    """The share at this moment, copied into ``staged`` (training may change the arrays), and the
    checksums of the rest of this rank's copies, as they are now, computed meanwhile."""
    others = crc.in_thread(lambda: records(save.others))
    at, copied = 0, []
    for call in save.calls:
        pieces = []
        for p in call:
            staged[at : at + p.nbytes] = p.memory
            pieces.append(dataclasses.replace(p, memory=staged[at : at + p.nbytes]))
            at += p.nbytes
        copied.append(pieces)
    save.calls, save.keep = copied, [staged]
    save.other_crcs, save.others = others.result(), []


def _drain(save: Save, header: bytes) -> None:
    """The background writer: POSIX writes of this rank's pieces, their checksums, fsync; how long it took."""
    began = time.monotonic()
    if sys.platform.startswith("linux"):  # a thread's own niceness: Linux only (elsewhere the process's)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
    try:
        mpiio.posix_write(save.tmp, header, save.calls)
        save.crcs = records(p for call in save.calls for p in call)
    except OSError as exc:
        save.error = mpiio.os_error(exc, "writing the checkpoint file", save.tmp)
    except BaseException as exc:  # whatever it is, every rank must hear of it at the wait
        save.error = mpiio.os_error(exc, "writing the checkpoint file", save.tmp)
    save.seconds = time.monotonic() - began
