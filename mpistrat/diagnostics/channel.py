"""One strategy's side-channel state (``Monitor.side``): what its side channel has asked, heard and
told (``side_channel.py`` sends and reads the messages).

Its own module so that the monitor can name it: ``side_channel.py`` reads the monitor.

>>> side = Channel()
>>> side.departed, side.unchecked
({}, {})
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Channel", "Diagnosis", "Event", "Result"]

Event = tuple[int, str, str]  # (seq, kind, "stall" | "timeout"): one event of one collective
Result = tuple[str, int]  # (who is missing and where, the rank that prints it: -1 each rank)


@dataclasses.dataclass
class Diagnosis:
    """An event this rank diagnoses: its query, when to stop waiting, who to tell besides the waiting."""

    qid: int
    began: float
    reporters: set[int]


class Channel:
    """One strategy's side-channel state (``Monitor.side``), touched with ``SideChannel.lock`` held."""

    def __init__(self) -> None:
        self.answers: dict[int, dict[int, dict[str, Any]]] = {}  # query id -> rank -> its state
        self.diagnosing: dict[Event, Diagnosis] = {}  # events this rank diagnoses for everyone
        self.results: dict[Event, Result] = {}  # made here or sent by the rank that diagnosed
        self.reported: dict[Event, tuple[int, float]] = {}  # (rank reported to, when)
        self.told: dict[Event, set[int]] = {}  # the ranks a result was sent to (each gets it once)
        self.departed: dict[int, tuple[int, str]] = {}  # rank -> (its last collective, why) after it exited
        # rank -> (when this rank heard, what was seen, its world rank): a rank whose process ended
        # before it said it leaves (diagnostics/deaths.py)
        self.deaths: dict[int, tuple[float, str, int]] = {}
        # rank -> its record of collectives left unchecked (MPISTRAT_CHECK=step) when it exited, flat
        # (seq, kind, code, ...): rank 0 compares them once every rank has left (farewell.py)
        self.unchecked: dict[int, list[Any]] = {}
