"""The side channel: the one place that sends messages to find out who is missing from a collective.

Who is missing is asked with point-to-point messages with a reserved tag on the
strategy's private communicator. MPI never matches point-to-point messages with
collectives, so this traffic cannot disturb the collective in progress, and no second
communicator is needed. Every rank's watchdog answers a query with where its main thread
is (inside which collective, or at which line of the program); a rank that does not
answer has exited, was killed, or is stuck outside Python. This needs MPI thread level
``MULTIPLE`` (mpi4py's default); below it there is no side channel and the messages say
the missing ranks are unknown.

One rank diagnoses each event (a stall or a timeout of one collective, keyed by
``(seq, kind, "stall" | "timeout")``) for everyone, so an event costs O(R) messages, not
one query round per waiting rank (which is 2(R-1)² messages with one straggler):

1. A waiting rank whose stall or timeout comes sends one ``report`` to the coordinator,
   rank 0 of the communicator. Rank 0's watchdog thread runs even while its main thread
   computes elsewhere, so rank 0 coordinates even when it is the missing rank.
2. The coordinator diagnoses the first report of an event itself (rank 0 waiting in the
   collective starts on its own timer): one ``query`` to every other rank and their
   ``answer``, gathered until every rank answered or ``LISTEN`` seconds passed, without
   blocking its thread. Ranks oversubscribed on few cores answer late; a rank that does
   not answer is named as such ("slow to answer, or killed, ..."), never as gone.
3. It sends the ``result`` to every rank that reported or was found waiting, so ranks
   whose own timer comes later already have it and report nothing. A report that comes
   after the result is answered with it directly. Only the rank that prints the diagnosis
   (the lowest waiting one) gets its O(R) text; the others get a line that points to it.

Per event that is at most R-1 reports, R-1 queries, R-1 answers and R-1 results, O(R)
bytes in all. A reporter that has no result ``WAIT`` seconds after reporting reports to the
next rank (1, then 2, ...), and diagnoses the event itself when its own rank comes up, so a
stopped or finished rank 0 costs ``WAIT`` seconds and R-1 reports per rank passed over,
and the explanation says who stood in. A rank that exits says so (``left``) to its
coordinator, which tells the others of the first: a collective it will never join ends at once
(``farewell.py``: the exit handshake, which also reads every message still on its way). A rank
whose process ended without saying so, seen by the rank that watches it (``deaths.py``), is
told of to every rank by that one (``died``): R-1 messages per death.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from typing import Any

from mpi4py import MPI

from mpistrat.diagnostics import diagnosis
from mpistrat.diagnostics.monitor import Channel, Diagnosis, Event, Monitor, Result

__all__ = ["GRACE", "LISTEN", "PATIENCE", "POLL", "TAG", "WAIT", "SideChannel"]

TAG = 0x6D73  # reserved on the private communicator for the watchdog's messages
POLL = 0.1  # seconds between the watchdog's looks (and the latency of its answers)
GRACE = 1.0  # seconds diagnose() waits for answers to a query by default
LISTEN = 4.0  # seconds a diagnosis waits for every answer: oversubscribed ranks answer late, not never
WAIT = LISTEN + 5 * POLL  # seconds a reporter waits for a result before reporting to the next rank
PATIENCE = 2 * WAIT + LISTEN  # seconds after a deadline to wait for its diagnosis (one stand-in fits)

_KEEP = 32  # events remembered per strategy (results, reports)


def _remember(table: dict[Event, Any], event: Event, value: Any) -> None:
    table[event] = value
    while len(table) > _KEEP:
        del table[next(iter(table))]


class SideChannel:
    """This process's end of the side channel: the watched monitors, and every message about them.

    One per process (the watchdog, ``watchdog.WATCHDOG``, is one). ``lock`` guards the
    registry and every side-channel MPI call, so no call touches a communicator being freed.
    """

    def __init__(self) -> None:
        # Weak: a strategy that is dropped without experimental_finalize() is collected, and its
        # communicator freed (see watchdog.release), instead of living on here until MPI runs out of them.
        self.registry: weakref.WeakSet[Monitor] = weakref.WeakSet()
        self.lock = threading.Lock()  # guards the registry and every side-channel MPI call
        self.queries = itertools.count(1)
        self.sends: list[MPI.Request] = []  # side-channel sends not yet received (kept until they are)
        self.pid = os.getpid()  # a forked child inherits this object and the exit hook, not the rank
        self.departed: dict[int, str] = {}  # world rank -> why, of every rank any strategy heard leave

    # -- called with ``lock`` held

    def send(self, mon: Monitor, message: tuple[Any, ...], dest: int) -> None:
        # Synchronous: complete once received, so the exit handshake (farewell.py) knows it was read.
        self.sends.append(mon.comm.issend(message, dest=dest, tag=TAG))

    def query(self, mon: Monitor, side: Channel) -> int:
        """Ask every other rank where it is; their answers are filed under the returned id."""
        qid = next(self.queries)
        side.answers[qid] = {}
        for r in range(mon.size):
            if r != mon.rank:
                self.send(mon, ("query", qid), r)
        return qid

    def coordinate(self, mon: Monitor, side: Channel, event: Event, reporter: int | None) -> None:
        """``reporter`` (None: this rank) waits in ``event``: answer it, or diagnose ``event`` for all."""
        if event in side.results:
            told = side.told.get(event)
            if told is None:
                told = set()
                _remember(side.told, event, told)
            if reporter is not None and reporter not in told:  # its report crossed the result: it has one
                told.add(reporter)
                speaker = side.results[event][1]
                self.send(mon, ("result", event, diagnosis.pointer(speaker), speaker), reporter)
        elif event in side.diagnosing:
            if reporter is not None:
                side.diagnosing[event].reporters.add(reporter)
        else:
            reporters = set() if reporter is None else {reporter}
            side.diagnosing[event] = Diagnosis(self.query(mon, side), time.monotonic(), reporters)

    def depart(
        self, mon: Monitor, side: Channel, rank: int, last: int, why: str, world: int, told_by: int
    ) -> None:
        """``rank`` exited after collective ``last``; the coordinator tells every other rank of the first."""
        if rank in side.departed:
            return
        first = not side.departed
        side.departed[rank] = (last, why)
        self.departed.setdefault(world, why)
        if first and told_by == rank:  # from the rank itself: this rank is its coordinator
            for r in range(mon.size):
                if r not in (rank, mon.rank):
                    self.send(mon, ("left", rank, last, why, world), r)

    def died(self, mon: Monitor, side: Channel, rank: int, why: str, world: int, tell: bool) -> None:
        """``rank``'s process ended before it said it leaves; with ``tell``, this rank saw it and
        tells every other rank."""
        if rank in side.deaths or rank in side.departed:
            return
        side.deaths[rank] = (time.monotonic(), why, world)
        if tell:
            for r in range(mon.size):
                if r not in (rank, mon.rank):
                    self.send(mon, ("died", rank, why, world), r)

    # -- each takes ``lock``: the watchdog thread's looks, a diagnosis from any thread, the exit hook

    def forget_sent(self) -> None:
        """Drop the sends that completed."""
        with self.lock:
            self.sends[:] = [r for r in self.sends if not r.Test()]

    def serve(self, mon: Monitor) -> None:
        """Answer queries, file answers and results, and take reports of events to diagnose."""
        side = mon.side
        if side is None:
            return
        with self.lock:
            if mon not in self.registry:
                return
            status = MPI.Status()
            while (message := mon.comm.improbe(MPI.ANY_SOURCE, TAG, status)) is not None:
                what, ref, *payload = message.recv()
                source = status.Get_source()
                if what == "query":
                    self.send(mon, ("answer", ref, mon.state()), source)
                elif what == "answer":
                    if ref in side.answers:
                        side.answers[ref][source] = payload[0]
                elif what == "report":
                    self.coordinate(mon, side, tuple(ref), source)
                elif what == "result":
                    _remember(side.results, tuple(ref), (payload[0], int(payload[1])))
                elif what == "died":  # ref: the rank whose process ended; payload: what was seen, world
                    self.died(mon, side, ref, payload[0], payload[1], tell=False)
                elif what == "left":  # ref: the rank that exited; payload: its last collective, why, world
                    self.depart(mon, side, ref, payload[0], payload[1], payload[2], told_by=source)
                    if len(payload) > 3 and source == ref:  # its unchecked collectives (farewell.py)
                        side.unchecked[ref] = payload[3]

    def advance(self, mon: Monitor) -> None:
        """Finish the diagnoses whose answers are in (or overdue), and send out their results."""
        side = mon.side
        if side is None or not side.diagnosing:
            return
        now = time.monotonic()
        with self.lock:
            if mon not in self.registry:
                return
            for event, job in list(side.diagnosing.items()):
                answers = side.answers[job.qid]
                if len(answers) < mon.size - 1 and now < job.began + LISTEN:
                    continue
                del side.diagnosing[event], side.answers[job.qid]
                answers[mon.rank] = mon.state()
                silent = {r for r in job.reporters if r not in answers}  # reported it, then stopped answering
                explanation, waiting = diagnosis.explain(
                    event[0], event[1], answers, mon.size, silent, now - job.began, mon.hosts
                )
                if mon.rank > 0:  # reports reach rank r only after ranks 0 to r-1 did not reply
                    explanation += diagnosis.stood_in(mon.rank)
                # The diagnosis (O(R) text with every rank's flight record) goes to one rank, the one
                # that speaks for the waiting ones; the others get a pointer to it. Sent to each, it
                # would cost O(R^2) bytes.
                full = explanation + diagnosis.records(mon, answers)
                speaker = min(waiting) if waiting else mon.rank
                pointer = diagnosis.pointer(speaker)
                _remember(side.results, event, (full if mon.rank == speaker else pointer, speaker))
                recipients = (job.reporters | set(waiting)) - {mon.rank}
                _remember(side.told, event, set(recipients))
                for r in sorted(recipients):
                    self.send(mon, ("result", event, full if r == speaker else pointer, speaker), r)

    def result(self, mon: Monitor, event: Event, now: float) -> Result | None:
        """The diagnosis of ``event`` (this rank waits in it) if it is here; else see that one is coming."""
        side = mon.side
        if side is None:
            return diagnosis.NO_SIDE_CHANNEL, -1
        with self.lock:
            if mon not in self.registry:
                return diagnosis.FINALIZED, -1
            if event in side.results:
                return side.results[event]
            if event in side.diagnosing:
                return None
            reported = side.reported.get(event)
            if reported is not None and now - reported[1] < WAIT:
                return None
            coordinator = 0 if reported is None else reported[0] + 1
            if coordinator < mon.rank:
                self.send(mon, ("report", event), coordinator)
                _remember(side.reported, event, (coordinator, now))
            else:  # rank 0, or every rank below this one failed to reply: diagnose it here
                self.coordinate(mon, side, event, None)
            return None

    def diagnose(self, mon: Monitor, start: float | None, grace: float = GRACE) -> tuple[str, list[int]]:
        """Ask every rank where it is, from this thread; return (who is missing, the waiting ranks).

        This rank counts as waiting. The watchdog does not call this on every waiting rank:
        one rank asks for all of them (see the module docstring).
        """
        seq, kind = mon.seq, mon.kind
        answers = self.ask(mon, start, grace)
        if answers is None:
            return (diagnosis.NO_SIDE_CHANNEL if mon.side is None else diagnosis.FINALIZED), [mon.rank]
        explanation, waiting = diagnosis.explain(seq, kind, answers, mon.size, {mon.rank}, grace, mon.hosts)
        return explanation + diagnosis.records(mon, answers), waiting

    def ask(
        self, mon: Monitor, start: float | None, grace: float = GRACE
    ) -> dict[int, dict[str, Any]] | None:
        """Every rank's answer to where it is (``Monitor.state``), this rank's too, from this thread:
        those that came within ``grace`` seconds (or while ``mon`` stays in the collective begun at
        ``start``). None without a side channel, or once ``mon`` is no longer watched."""
        side = mon.side
        if side is None:
            return None
        with self.lock:
            if mon not in self.registry:
                return None
            qid = self.query(mon, side)
        end = time.monotonic() + grace
        while time.monotonic() < end and len(side.answers[qid]) < mon.size - 1 and mon.start == start:
            time.sleep(POLL / 5)
            self.serve(mon)
        with self.lock:
            answers = side.answers.pop(qid)
        answers[mon.rank] = mon.state()
        return answers
