"""A thread that moves non-blocking sums on while the caller computes outside MPI.

MPICH (and any MPI library without an asynchronous progress thread) moves a non-blocking
collective on only inside MPI calls: a backward pass makes none between the gradients it yields,
so a sum started early would wait for the next one. While a :class:`Pump` runs, a thread enters
MPI's progress engine every :data:`PERIOD` seconds, the Python lock let go in between: an
``Iprobe`` on ``COMM_WORLD`` for :data:`TAG`, which nothing sends, so it can match no message
(a probe never receives one anyway). It touches no request and no communicator of a strategy, so
it cannot pair up with a collective or change what one moves, creates nothing that would need
every rank, and makes no blocking call: it cannot hang a job. (A duplicate of ``COMM_SELF``
would be its own without a collective, but MPICH answers a probe there without polling the
network, and the sums between nodes did not move.) It needs MPI thread level ``MULTIPLE``
(mpi4py's default); below it :meth:`Pump.start` does nothing.

>>> pump = Pump()
>>> pump.start(); pump.stop()  # a thread while sums are in flight, none after
>>> pump.thread is None
True
"""

from __future__ import annotations

import threading
import time

from mpi4py import MPI

__all__ = ["PERIOD", "TAG", "Pump"]

# Seconds between two entries into MPI's progress engine (0: no thread). The generator step's sums
# between two virtual nodes move at 0.2 ms (docs/performance.md); a sleep this short still lets the
# core go to the computation it shares.
PERIOD = 0.0002
TAG = 0x6D70  # probed for, never sent


class Pump:
    """One step's progress thread: :meth:`start` (again: nothing), :meth:`stop` (always, in a ``finally``)."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.running = False

    def start(self) -> None:
        """Start the thread, unless it runs, :data:`PERIOD` is 0 or MPI is not thread level ``MULTIPLE``."""
        if self.thread is not None or not PERIOD or MPI.Is_finalized():
            return
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return
        self.running = True
        self.thread = threading.Thread(target=self.run, args=(PERIOD,), name="mpistrat-progress", daemon=True)
        self.thread.start()

    def run(self, period: float) -> None:
        try:
            while self.running:
                MPI.COMM_WORLD.Iprobe(MPI.ANY_SOURCE, TAG)  # mpi4py lets the Python lock go inside
                time.sleep(period)
        except Exception:  # an MPI error here only ends the help: the step's own calls report theirs
            self.running = False

    def stop(self) -> None:
        """Stop the thread and wait for it (at most one period and one ``Iprobe``)."""
        if self.thread is None:
            return
        self.running = False
        self.thread.join()
        self.thread = None
