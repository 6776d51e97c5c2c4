"""The settings of the observability features, read from the environment in one place.

=================================  =============================================================
``MPISTRAT_TIMELINE=DIR``          each rank writes its collectives and spans to ``DIR``
``MPISTRAT_FLIGHT_RECORDS=N``      collectives each rank remembers for a diagnosis (default 8)
``MPISTRAT_STRAGGLER_SUMMARY``     ``auto`` (default): the end-of-job summary when a rank was a
                                   straggler; ``always``; ``off``
``MPISTRAT_STRAGGLER_MS=X``        mean lateness below which no rank is called a straggler (5)
=================================  =============================================================

>>> settings().flight_records >= 0
True
"""

from __future__ import annotations

import dataclasses
import math
import os

from mpistrat.errors import InvalidArgumentError

__all__ = ["Settings", "settings"]

_SUMMARY = ("auto", "always", "off")


@dataclasses.dataclass(frozen=True)
class Settings:
    timeline: str | None = None
    flight_records: int = 8
    straggler_summary: str = "auto"
    straggler_ms: float = 5.0


def settings() -> Settings:
    """The observability settings in the environment now; a bad value raises, naming it."""
    env = os.environ
    records = env.get("MPISTRAT_FLIGHT_RECORDS", "").strip() or "8"
    if not records.isdigit():
        raise InvalidArgumentError(f"MPISTRAT_FLIGHT_RECORDS must be a whole number >= 0; got {records!r}")
    summary = (env.get("MPISTRAT_STRAGGLER_SUMMARY", "").strip().lower() or "auto").replace("0", "off")
    summary = {"1": "always", "on": "always", "no": "off", "false": "off"}.get(summary, summary)
    if summary not in _SUMMARY:
        expected = ", ".join(_SUMMARY)
        raise InvalidArgumentError(f"MPISTRAT_STRAGGLER_SUMMARY must be one of {expected}; got {summary!r}")
    raw_ms = env.get("MPISTRAT_STRAGGLER_MS", "").strip() or "5"
    try:
        ms = float(raw_ms)
    except ValueError:
        ms = -1.0
    if math.isnan(ms) or ms < 0:
        raise InvalidArgumentError(f"MPISTRAT_STRAGGLER_MS must be milliseconds >= 0; got {raw_ms!r}")
    return Settings(env.get("MPISTRAT_TIMELINE", "").strip() or None, int(records), summary, ms)
