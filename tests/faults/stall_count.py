"""Rank ``LATE`` (argv; -1: the last) arrives late at an all_reduce; count the watchdog's messages.

Run with MPISTRAT_STALL_WARNING_SECONDS=1. The late rank sleeps past the warning's diagnosis,
or with ``--freeze`` stops itself (SIGSTOP: no watchdog answers either) until another rank
continues it once a stand-in has diagnosed the stall. With ``--slow K``, K waiting ranks are
alive but slow to answer: their watchdog thread gets round to the side channel 2 s late, as on
an oversubscribed node. The warning must still name only the late rank. Every rank records its
side-channel sends (``issend``: nothing but the watchdog uses it) while the late collective
runs, and keeps the stall warnings it logs; rank 0 prints the totals over all ranks (messages,
bytes) and checks that exactly one warning was logged, naming the late rank and no other.
"""

import logging
import os
import signal
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.diagnostics import side_channel, watchdog
from mpistrat.log import logger
from tests.support.counting import CountingComm, Ledger


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


world = MPI.COMM_WORLD  # the script's own communicator: the strategy's duplicate is the counting one
rank, size = world.Get_rank(), world.Get_size()
late = int(sys.argv[1]) % size
freeze = "--freeze" in sys.argv
slow = int(sys.argv[sys.argv.index("--slow") + 1]) if "--slow" in sys.argv else 0


def slowly(serve):
    """The watchdog thread's side-channel service, 2 s late each time (the main thread is not slowed:
    the rank is in the collective on time, and only its answers come late)."""

    def serve_late(mon):
        time.sleep(2.0)
        serve(mon)

    return serve_late


pids = world.allgather(os.getpid())
kept = Kept()
logger.addHandler(kept)
strategy = mpistrat.MPIStrategy(CountingComm(world))
step = lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(4))  # noqa: E731
strategy.run(step)
with Ledger.recording() as ledger:
    if freeze and rank == max(set(range(size)) - {late}):
        # Past the coordinator's wait for a result, and the stand-in's diagnosis.
        waker = threading.Timer(
            1 + side_channel.WAIT + side_channel.LISTEN + 2, os.kill, (pids[late], signal.SIGCONT)
        )
        waker.start()
    if rank in range(1, slow + 1) and rank != late:
        watchdog.WATCHDOG.serve = slowly(watchdog.WATCHDOG.serve)
    if rank == late:
        if freeze:
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(1 + side_channel.LISTEN + 2)  # past the stall warning and its diagnosis
    total = strategy.run(step)
    time.sleep(0.5)  # anything the watchdog still sends about this stall is counted too
assert total.tolist() == [float(size)] * 4, total
sent = ledger.only("issend")
messages, nbytes = world.allreduce(sent.calls), world.allreduce(sent.sent)
warnings = [m for ms in world.allgather([m for m in kept.messages if "has waited" in m]) for m in ms]
if rank == 0:
    how = "frozen" if freeze else "late"
    print(
        f"side-channel messages for one stall at {size} ranks (rank {late} {how}): "
        f"{messages}, {nbytes} bytes",
        flush=True,
    )
    where = "did not answer" if freeze else "is not in a collective"
    assert len(warnings) == 1, warnings
    assert f"waiting for rank {late}: rank {late} {where}" in warnings[0], warnings
    assert "did not answer" not in warnings[0] or freeze, warnings  # a slow waiting rank is not missing
print(f"rank {rank} finished", flush=True)
