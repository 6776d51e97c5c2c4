"""Who arrives last: straggler attribution carried in the handshake, at no extra message.

Each rank times how long it waited in a collective's handshake: the last rank to arrive
waits about nothing, the first waits the whole spread. The next handshake carries that
time in two more slots of its ``Allreduce(MAX)``, encoded with the rank in the low bits:
``(-wait, rank)`` selects the last arrival, ``(wait, rank)`` the longest wait. Every rank
so learns, one collective later, who arrived last and how long it kept the others
waiting (longest wait minus shortest), and keeps the same running tally.

>>> tally = Tally(rank=0, size=2)
>>> tally.learn(NOTHING, NOTHING, 0.0)  # the first handshake: nothing measured before it
>>> tally.collectives
0
>>> last, longest = _combine([_pair(0, 30_000), _pair(1, 5)])  # rank 1 came 30 ms after rank 0
>>> tally.learn(last, longest, 0.0)
>>> table = tally.table()
>>> table.rows[1].times_last, round(table.rows[1].mean_ms, 3)
(1, 29.995)
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import weakref

import numpy as np
from mpi4py import MPI

from mpistrat.log import ANY_RANK, logger

__all__ = ["StragglerRow", "Stragglers", "Tally", "significant"]

RANK_BITS = 20  # ranks up to 2**20 fit below the wait
_MASK = (1 << RANK_BITS) - 1
_MAX_WAIT_US = (1 << 40) - 1  # 12 days: the encoded pair stays far inside int64
_MAX_WAIT_S = _MAX_WAIT_US / 1e6
FOLD_EVERY = 8192  # numbers filed before a bulk decode
NOTHING = -(1 << 62)  # "no measured handshake": loses every MAX
MIN_MEAN_MS = 5.0  # below this on average a rank is not called a straggler (scheduling noise reaches ms)
# A straggler is last so often that chance would do it with probability below FALSE_ALARM, over
# all the ranks together (each is tested at FALSE_ALARM / size).
FALSE_ALARM = 1e-3
SHOWN = 5  # rows of the table beyond the flagged ranks; the others are summed up in one line

_tallies: weakref.WeakSet[Tally] = weakref.WeakSet()


def _pair(rank: int, wait_us: int) -> tuple[int, int]:
    """The two slot values one rank sends: (-wait, rank) and (wait, rank)."""
    return (-wait_us << RANK_BITS) | rank, (wait_us << RANK_BITS) | rank


def _combine(pairs: list[tuple[int, int]]) -> tuple[int, int]:
    """What MAX over the ranks makes of their pairs (for examples and tests)."""
    return max(p[0] for p in pairs), max(p[1] for p in pairs)


@dataclasses.dataclass(frozen=True)
class StragglerRow:
    """One rank's record: how often it arrived last, and how long the others waited for it."""

    rank: int
    times_last: int
    share: float  # of the collectives tallied
    total_ms: float
    mean_ms: float  # per collective in which it was last
    worst_ms: float
    flagged: bool
    world: int  # its rank in MPI.COMM_WORLD
    host: str = ""  # its host, where the ranks span several

    @property
    def name(self) -> str:
        """``rank 1``, or ``rank 1 (world 3)`` on a communicator that is not the world in order, and
        `` on nodeb`` where the ranks span several hosts."""
        name = f"rank {self.rank}" if self.world == self.rank else f"rank {self.rank} (world {self.world})"
        return f"{name} on {self.host}" if self.host else name


@dataclasses.dataclass(frozen=True)
class Stragglers:
    """The tally of every rank, as :meth:`StrategyExtended.stragglers` returns it.

    ``str()`` of it is a table; ``flagged`` lists the ranks that were last markedly
    more often than chance, by ``MIN_MEAN_MS`` or more on average.
    """

    collectives: int
    rows: list[StragglerRow]

    @property
    def flagged(self) -> list[int]:
        return [row.rank for row in self.rows if row.flagged]

    def __str__(self) -> str:
        renamed = any(r.world != r.rank for r in self.rows)
        world = f" {'world':>5}" if renamed else ""
        width = max((max(len(r.host), 4) for r in self.rows if r.host), default=0)  # 4: "host"
        host = f" {'host':<{width}}" if width else ""
        columns = f"{'last':>7} {'share':>6} {'mean ms':>8} {'worst ms':>9} {'total s':>8}"
        lines = [
            f"last arrivals over {self.collectives:,} collectives",
            f"{'rank':>5}{world}{host} {columns}",
        ]
        shown = sorted(self.rows, key=lambda r: (not r.flagged, -r.times_last, r.rank))
        flagged = sum(r.flagged for r in self.rows)
        rest = shown[flagged + SHOWN :]
        for r in sorted(shown[: flagged + SHOWN], key=lambda r: r.rank):
            mark = "  <- straggler" if r.flagged else ""
            lines.append(
                f"{r.rank:5d}{f' {r.world:5d}' if renamed else ''}{f' {r.host:<{width}}' if width else ''} "
                f"{r.times_last:7d} {r.share:6.0%} "
                f"{r.mean_ms:8.2f} {r.worst_ms:9.2f} {r.total_ms / 1e3:8.3f}{mark}"
            )
        if rest:
            most = max(r.times_last for r in rest)
            lines.append(f"  ... {len(rest)} other ranks, each the last to arrive {most} times or fewer")
        return "\n".join(lines)

    def summary(self) -> str:
        """One sentence per flagged rank; empty when none is flagged."""
        return "; ".join(
            f"{r.name} was the last to arrive in {r.share:.0%} of {self.collectives:,} collectives, "
            f"{r.mean_ms:.1f} ms late on average ({r.total_ms / 1e3:.2f} s in all)"
            for r in self.rows
            if r.flagged
        )


def significant(times_last: int, collectives: int, size: int, mean_ms: float, min_mean_ms: float) -> bool:
    """Whether a rank last ``times_last`` of ``collectives`` times is a straggler, not chance.

    Chance makes each of ``size`` ranks last with probability 1/size. A straggler is last so
    often that the binomial tail P(X >= times_last) is below ``FALSE_ALARM / size`` (so that a
    job of any size flags nobody by chance), and late by ``min_mean_ms`` on average. An exact
    tail, not a normal approximation: once in 9 collectives among 128 ranks is no evidence.

    >>> significant(48, 50, 4, 20.0, 1.0), significant(16, 50, 4, 20.0, 1.0)
    (True, False)
    >>> significant(1, 9, 128, 20.0, 1.0)
    False
    """
    if collectives == 0 or size < 2 or mean_ms < min_mean_ms:
        return False
    return binomial_tail(times_last, collectives, 1.0 / size) < FALSE_ALARM / size


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space (exact enough for any n here).

    >>> abs(binomial_tail(1, 9, 1 / 128) - (1 - (127 / 128) ** 9)) < 1e-12  # at least one of 9
    True
    >>> abs(binomial_tail(9, 10, 0.5) - 11 / 1024) < 1e-12, binomial_tail(0, 5, 0.5)
    (True, 1.0)
    """
    if k <= 0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        for i in range(k, n + 1)
    ]
    top = max(terms, default=-math.inf)
    return 0.0 if top == -math.inf else math.exp(top) * sum(math.exp(t - top) for t in terms)


class Tally:
    """The running tally of one communicator's handshakes; the same on every rank.

    ``learn`` runs in every handshake, so it only files the two numbers; they are
    decoded in bulk (NumPy) every few thousand, and whenever the table is asked for.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        min_mean_ms: float = MIN_MEAN_MS,
        summary: str = "auto",
        world: tuple[int, ...] | None = None,
    ):
        self.rank, self.size, self.min_mean_ms, self.summary = rank, size, min_mean_ms, summary
        self.world = world  # each rank's rank in MPI.COMM_WORLD (None: the same numbers)
        self.hosts: tuple[str, ...] = ()  # each rank's host, where they are several (see Collectives.locate)
        self.enabled = size > 1 and size <= _MASK + 1
        self._collectives = 0
        self.times_last = np.zeros(size, dtype=np.int64)
        self.total_us = np.zeros(size, dtype=np.int64)
        self.worst_us = np.zeros(size, dtype=np.int64)
        self._filed: list[int] = []  # (last, longest) pairs not yet decoded
        self.outgoing = (NOTHING, NOTHING)  # what the next handshake carries from this rank
        if self.enabled:
            _tallies.add(self)
            _at_exit_once()

    def learn(self, last: int, longest: int, waited: float) -> None:
        """Take the previous handshake's result from this one, and this rank's wait (seconds) in it."""
        if last > NOTHING:
            self.file(last, longest)
        if self.enabled:
            shifted = (int(waited * 1e6) if waited < _MAX_WAIT_S else _MAX_WAIT_US) << RANK_BITS
            self.outgoing = (self.rank - shifted, shifted + self.rank)

    def file(self, last: int, longest: int) -> None:
        """File a measured handshake's last arrival and longest wait (as the handshake combined them)."""
        filed = self._filed
        filed += (last, longest)
        if len(filed) >= FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        filed, self._filed = self._filed, []
        if not filed:
            return
        pairs = np.array(filed, dtype=np.int64).reshape(-1, 2)
        last, longest = pairs[:, 0], pairs[:, 1]
        ranks = last & _MASK
        imposed = (longest >> RANK_BITS) + (last >> RANK_BITS)  # longest wait - shortest
        self._collectives += len(pairs)
        np.add.at(self.times_last, ranks, 1)
        np.add.at(self.total_us, ranks, imposed)
        np.maximum.at(self.worst_us, ranks, imposed)

    @property
    def collectives(self) -> int:
        """Collectives tallied so far."""
        return self._collectives + len(self._filed) // 2

    def forget(self) -> None:
        """Send nothing at the next handshake (the one just done is not worth tallying)."""
        self.outgoing = (NOTHING, NOTHING)

    def table(self) -> Stragglers:
        self._fold()
        n = self._collectives
        rows = []
        for r in range(self.size):
            last, total = int(self.times_last[r]), int(self.total_us[r]) / 1e3
            mean = total / last if last else 0.0
            rows.append(
                StragglerRow(
                    rank=r,
                    times_last=last,
                    share=last / n if n else 0.0,
                    total_ms=total,
                    mean_ms=mean,
                    worst_ms=int(self.worst_us[r]) / 1e3,
                    flagged=significant(last, n, self.size, mean, self.min_mean_ms),
                    world=r if self.world is None else self.world[r],
                    host=self.hosts[r] if r < len(self.hosts) else "",
                )
            )
        return Stragglers(n, rows)


def world_ranks(comm: MPI.Intracomm) -> tuple[int, ...] | None:
    """Each rank of ``comm``'s rank in ``MPI.COMM_WORLD``; None when they are the same numbers.

    Group arithmetic, local to each rank: no message is sent.
    """
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        ranks = tuple(int(r) for r in group.Translate_ranks(list(range(comm.Get_size())), world))
    finally:
        group.Free()
        world.Free()
    return None if ranks == tuple(range(len(ranks))) else ranks


def note(tally: Tally | None) -> str:
    """The flagged ranks in a sentence for a warning (empty when none is flagged)."""
    return "" if tally is None or tally.collectives == 0 else tally.table().summary()


_registered = False


def _at_exit_once() -> None:
    global _registered
    if not _registered:
        _registered = True
        atexit.register(summarize)  # after mpi4py's: atexit runs it first, while MPI is up


def summarize() -> None:
    """The end-of-job summary, logged by each communicator's rank 0 (``MPISTRAT_STRAGGLER_SUMMARY``)."""
    for tally in list(_tallies):
        if tally.rank != 0 or tally.summary == "off" or tally.collectives == 0:
            continue
        table = tally.table()
        if tally.summary == "always" or table.flagged:
            found = table.summary() or "no rank was a straggler"
            logger.warning(
                f"stragglers over {tally.size} ranks: {found}\n{table}\n"
                "(MPISTRAT_STRAGGLER_SUMMARY=off silences this; =always prints it every time)",
                extra=ANY_RANK,
            )
