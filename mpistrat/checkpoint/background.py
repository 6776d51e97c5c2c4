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

All of a strategy's background saves in flight on this rank are one :class:`BackgroundSaves`
(:func:`saves_of`): its :class:`Writer` records and a kept failure.
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

__all__ = ["BackgroundSaves", "Writer", "saves_of", "start", "wait_for_saves", "writing"]

# A background writer's niceness (Linux, this thread only): the training step keeps its CPU.
WRITER_NICENESS = 10
# What a step's end agrees on while a save is pending (the name in a mismatch or a stall warning).
POLL = "checkpoint (background save written?)"


@dataclasses.dataclass
class Writer:
    """One background save on this rank: the save and its thread."""

    save: Save
    thread: threading.Thread

    @property
    def busy(self) -> bool:
        return self.thread.is_alive()


class BackgroundSaves:
    """The background saves over one strategy's collectives that this rank has started and not yet
    finished, and a failure found at the end of a step, kept for the next checkpoint call.

    Every rank holds the same saves in the same order (a save is collective), so each decision
    below is taken on every rank alike. States: a save is *written* on a rank once its writer's
    thread ended; it is *in place* once :meth:`finish` ran (collective), and then leaves
    :attr:`writers`.
    """

    def __init__(self, collectives: Collectives):
        self.collectives = collectives
        self.writers: list[Writer] = []
        self.failure: BaseException | None = None  # from a finish at a step's end, raised at the next call

    def start(self, save: Save) -> None:
        """Copy this rank's pieces aside and write them in a thread (:func:`start`)."""
        close(save)  # collective; the thread writes with POSIX calls
        _stage(save)
        header = save.header if self.collectives.rank == 0 else b""
        thread = threading.Thread(target=_drain, args=(save, header), name="mpistrat-checkpoint", daemon=True)
        save.thread = thread
        thread.start()
        self.writers.append(Writer(save, thread))
        self.collectives.pending["checkpoint saves"] = self.wait
        self.collectives.after_step["checkpoint saves"] = self.poll
        self.collectives.abandon["checkpoint saves"] = self.abandon

    def busy(self) -> bool:
        """Whether a writer of this rank is still writing."""
        return any(w.busy for w in self.writers)

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
        """Finish every save (collective): wait for its writers, put it in place (rank 0 completes
        the header and renames the file), run its ``in_place``; raise the first failure."""
        for work in (self.collectives.after_step, self.collectives.pending, self.collectives.abandon):
            work.pop("checkpoint saves", None)
        failure: BaseException | None = None
        while self.writers:
            writer = self.writers.pop(0)
            save = writer.save
            try:
                seconds = finish(save, self.collectives)
            except PeerFailedError:  # a rank died: none of them lands
                self.writers.insert(0, writer)
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
        if not self.writers and self.failure is None:
            return
        self.collectives.agree(
            "checkpoint (background saves)",
            fingerprint=len(self.writers),
            describe=lambda: {"leaves": [("background saves", f"{len(self.writers)} pending", None)]},
            options=ALWAYS,
        )
        kept, self.failure = self.failure, None
        if self.writers:
            self.finish()
        if kept is not None:
            raise kept

    def abandon(self) -> None:
        """Drop every save: a rank died, the communicator is lost (local, no communication). Their
        temporary files are removed, never put in place, so the previous checkpoint stays the latest;
        a writer still running ends on its own."""
        for work in (self.collectives.after_step, self.collectives.pending, self.collectives.abandon):
            work.pop("checkpoint saves", None)
        _saves.pop(id(self.collectives), None)
        self.failure = None
        while self.writers:
            save = self.writers.pop(0).save
            with contextlib.suppress(OSError):
                os.remove(save.tmp)
            logger.warning(
                "Checkpoint.%s: the background save of %s is abandoned (a rank died); the previous "
                "checkpoint stays the latest",
                save.method,
                save.path,
            )


# The saves of each strategy's collectives (by id: held while a save is in flight or a failure kept).
_saves: dict[int, BackgroundSaves] = {}
_exit_hook = False
# The last staging buffer, kept for the next background save: a fresh one page-faults on every
# byte it is copied into (0.23 s for 100 MiB here, longer than writing it to the page cache).
# The peak is unchanged (a background save holds a staged share anyway); between saves the rank
# keeps one share more.
_staging: np.ndarray | None = None


def saves_of(collectives: Collectives) -> BackgroundSaves:
    """The background saves over ``collectives`` (made at the first)."""
    saves = _saves.get(id(collectives))
    if saves is None:
        saves = _saves[id(collectives)] = BackgroundSaves(collectives)
    return saves


def start(save: Save, collectives: Collectives) -> None:
    """Copy this rank's pieces aside and write them in a thread; the file is put in place at the end
    of the first step after which every rank's share is written, or by the next checkpoint call
    (or the end of the job), which then runs its ``in_place`` on every rank."""
    global _exit_hook
    saves_of(collectives).start(save)
    if not _exit_hook:  # registered after MPI's own: runs before MPI is finalized (atexit is LIFO)
        atexit.register(_finish_at_exit)
        _exit_hook = True


def wait_for_saves(collectives: Collectives) -> None:
    """Finish every background save over ``collectives`` (collective); raise the first failure.
    Called on one rank alone, it fails on every rank, and each keeps its saves."""
    saves = _saves.get(id(collectives))
    if saves is not None:
        saves.wait()
        del _saves[id(collectives)]


def writing() -> bool:
    """Whether a background save is still being written on this rank (its thread has not ended)."""
    return any(saves.busy() for saves in list(_saves.values()))


def _stage(save: Save) -> None:
    """The share at this moment, copied into the staging buffer (training may change the arrays),
    and the checksums of the rest of this rank's copies, as they are now, computed meanwhile."""
    others = crc.in_thread(lambda: records(save.others))
    total = sum(p.nbytes for call in save.calls for p in call)
    staged = _staging_buffer(total)
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


def _staging_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` bytes to stage a share in: the last save's buffer when no writer still reads it."""
    global _staging
    if _staging is None or _staging.nbytes < nbytes or writing():
        _staging = np.empty(nbytes, np.uint8)
    return _staging[:nbytes]


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


def _finish_at_exit() -> None:
    """At the end of the job: finish what is still being written (every rank is here)."""
    while _saves:
        saves = _saves.popitem()[1]
        if not saves.writers:  # a failure kept from a step's end was logged there
            continue
        if MPI.Is_finalized() or saves.collectives.freed:
            logger.error("Checkpoint: a background save could not finish: MPI is finalized")
            continue
        try:
            saves.finish()
        except BaseException as exc:
            logger.error("Checkpoint: a background save failed at exit: %s", exc)
