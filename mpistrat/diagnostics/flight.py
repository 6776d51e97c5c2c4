"""The flight recorder: each rank's last few handshakes, for the diagnosis of a hang.

Every handshake that sends (the check on, or an ``all_gather``) writes one entry into a
ring of ``MPISTRAT_FLIGHT_RECORDS`` (default 8): its sequence number, kind, fingerprint,
when it began and when it completed. Under ``MPISTRAT_CHECK=step`` the collectives that sent
nothing since the last handshake are shown among them, from the step check's record (``step``:
number, kind, code, flat; no times: they waited for nothing), until a handshake checked them.
The watchdog's answers carry the record, so a stall warning or a timeout shows where every rank
has been, and an uncaught exception prints this rank's. The call site of each entry is found
only while the timeline is on (finding it costs about 1 µs); the site of the collective in
progress is always in the diagnosis.

>>> ring = Flight(2)
>>> ring.append(entry(1, "all_reduce", 0x2A, began=10.0))
>>> ring[-1][ENDED] = 10.5
>>> ring.append(entry(2, "all_gather", 7, began=11.0))
>>> for part in ring.describe(now=13.0, busy=True, agreed=False).split("; "):
...     print(part)
#1 all_reduce [fp 0000002a] done 2.5 s ago
#2 all_gather [fp 00000007] in its handshake for 2.0 s
"""

from __future__ import annotations

import collections
import itertools
import time
import weakref
from typing import Any, Protocol

from mpistrat.diagnostics import abort

__all__ = ["Flight", "block", "split"]

SEQ, KIND, FINGERPRINT, BEGAN, ENDED, STATE, SITE = range(7)  # the fields of an entry
UNCHECKED = "unchecked until the step's closing handshake (MPISTRAT_CHECK=step)"  # such an entry's state
MARK = "\nflight records"  # where a diagnosis's records begin (see split)


class Recording(Protocol):
    """What the recorder reads of ``MPISTRAT_CHECK=step``'s check (``collectives.step_check.StepCheck``)."""

    @property
    def record(self) -> list[Any]:
        """The collectives no handshake checked yet: number, kind and code of each, flat."""


def entry(seq: int, kind: str, fingerprint: int, began: float) -> list[Any]:
    """A new entry (the handshake builds the same list inline, then sets ``ENDED``, perhaps ``STATE``)."""
    return [seq, kind, fingerprint, began, None, None, None]


class Flight(collections.deque[list[Any]]):
    """A ring of the last ``n`` handshake entries of one communicator (a deque: C-speed appends).

    ``owner`` names what communicates on it (``"MPIStrategy #2"``): a rank's records then read
    ``MPIStrategy #2 (3 ranks): ...``, in the order the rings were made.
    """

    __eq__ = object.__eq__  # one ring per communicator: identity, not contents (kept in a WeakSet)
    __hash__ = object.__hash__  # type: ignore[assignment]  # deque sets it to None

    def __init__(self, n: int, owner: str = "a strategy", size: int = 0):
        super().__init__(maxlen=n)
        # MPISTRAT_CHECK=step's check, whose record of the collectives that sent nothing since the
        # last handshake shows among the entries (None: the check is not per step).
        self.step: Recording | None = None
        self.number = next(_numbers)
        self.label = f"{owner} ({size} rank{'s' if size != 1 else ''})" if size else owner
        if n:
            _live.add(self)

    def unchecked(self) -> list[Any]:
        """A copy of the step check's record (empty: none)."""
        return [] if self.step is None else list(self.step.record)

    def entries(self) -> list[list[Any]]:
        """The last ``maxlen`` entries, the unchecked collectives' among them, oldest first."""
        kept = self.maxlen or 0
        ring, record = list(self), self.unchecked()[-3 * kept :] if kept else []  # copies: others write
        if not record:
            return ring
        unchecked = [[*record[i : i + 3], 0.0, 0.0, UNCHECKED, None] for i in range(0, len(record), 3)]
        return sorted(ring + unchecked, key=lambda e: e[SEQ])[-kept:]

    def describe(self, now: float, busy: bool, agreed: bool) -> str:
        """The record on one line. ``busy``: this rank is in a collective; ``agreed``: past its handshake."""
        entries = self.entries()
        if not entries:
            return "no handshake yet (or the check is off)"
        parts = []
        for i, (seq, kind, fp, began, ended, state, site) in enumerate(entries):
            current = busy and i == len(entries) - 1
            if ended is None:
                how = f"in its handshake for {now - began:.1f} s" if current else "left its handshake raising"
            elif state is not None:
                how = state
            elif current and agreed:
                how = f"past its handshake (transferring) for {now - ended:.1f} s"
            else:
                how = f"done {now - ended:.1f} s ago"
            where = f" at {site}" if site else ""
            parts.append(f"#{seq} {kind}{where} [fp {fp & (2**32 - 1):08x}] {how}")
        return "; ".join(parts)


_live: weakref.WeakSet[Flight] = weakref.WeakSet()
_numbers = itertools.count(1)


def last_words() -> str:
    """This rank's flight records, one line per strategy in creation order (printed when an uncaught
    exception aborts the job)."""
    now = time.monotonic()
    rings = sorted((f for f in list(_live) if len(f)), key=lambda f: f.number)
    if not rings:
        return ""
    kept = max(f.maxlen or 0 for f in rings)
    return f"{MARK[1:]} (this rank's last {kept} handshakes per strategy, oldest first):\n" + "\n".join(
        f"  {f.label}: {f.describe(now, busy=False, agreed=False)}" for f in rings
    )


abort.add_last_words(last_words)


def block(records: dict[int, str | None], size: int, kept: int) -> str:
    """Every rank's record, one line each, to follow a diagnosis (``records``: rank -> record)."""
    lines = [f"{MARK[1:]} (each rank's last {kept} handshakes, oldest first):"]
    for r in range(size):
        record = records.get(r)
        lines.append(f"  rank {r}: {record if record is not None else 'no answer'}")
    return "\n" + "\n".join(lines)


def split(explanation: str) -> tuple[str, str]:
    """A diagnosis's explanation and its flight records (empty if it has none)."""
    at = explanation.find(MARK)
    return (explanation, "") if at < 0 else (explanation[:at], explanation[at:])
