"""Every ``MPISTRAT_*`` environment variable, read by one rule.

:func:`read` is the only reader. An unset or empty variable gives the default; a value
the setting does not expect gives a ``RuntimeWarning`` naming the variable (once per
value) and the default, as mpi4py does with its ``MPI4PY_RC_*`` variables. Ranks may
see different values (an MPMD launch): nothing here depends on them agreeing.

A strategy's settings (``CHECK``, ``TIMEOUT``, ``STALL_WARNING_SECONDS``, ``TIMELINE``,
``FLIGHT_RECORDS``, ``STRAGGLER_*``) are read when the strategy is created; the process's
(``ABORT_ON_EXCEPTION``, ``LOG_ALL_RANKS``, ``CUDA_AWARE``, ``DEVICE``) when they take effect.
``docs/configuration.md`` is the table of :data:`SETTINGS`.

>>> read("MPISTRAT_STALL_WARNING_SECONDS", env={})
60.0
>>> read("MPISTRAT_TIMEOUT", env={"MPISTRAT_TIMEOUT": "off"}) is None
True
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SETTINGS", "Setting", "given", "read"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(raw: str) -> bool:
    raw = raw.lower()
    if raw in _TRUE + _FALSE:
        return raw in _TRUE
    raise ValueError("1/true/yes/on or 0/false/no/off")


def _optional_flag(raw: str) -> bool | None:
    return None if raw.lower() == "auto" else _flag(raw)


def _seconds(raw: str) -> float | None:
    raw = raw.lower()
    if raw in ("off", "none", "no", "false"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value < 0:
        raise ValueError("a number of seconds, or 0/off to disable")
    return None if value == 0 or math.isinf(value) else value


def _check(raw: str) -> int:
    raw = raw.lower()
    if raw in ("2", "strict"):
        return 2
    try:
        return int(_flag(raw))
    except ValueError:
        raise ValueError("0/off, 1/on or strict") from None


def _count(raw: str) -> int:
    if not raw.isdigit():
        raise ValueError("a whole number >= 0")
    return int(raw)


def _milliseconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value < 0 or math.isinf(value):
        raise ValueError("milliseconds >= 0")
    return value


def _summary(raw: str) -> str:
    raw = raw.lower()
    named = {"1": "always", "on": "always", "0": "off", "no": "off", "false": "off"}.get(raw, raw)
    if named not in ("auto", "always", "off"):
        raise ValueError("auto, always or off")
    return named


def _directory(raw: str) -> str | None:
    return None if raw.lower() in ("0", "off", "no", "false") else raw  # a path keeps its case


def _device(raw: str) -> str:
    raw = raw.lower()
    if raw not in ("auto", "gpu", "cpu"):
        raise ValueError("auto, gpu or cpu")
    return raw


@dataclasses.dataclass(frozen=True)
class Setting:
    """One environment variable: how its value is read, its default, and what it does."""

    name: str
    parse: Callable[[str], Any]  # the stripped value; ValueError says what it expects
    default: Any
    values: str
    means: str


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "MPISTRAT_CHECK",
            _check,
            1,
            "`0`/`off`, `1`/`on`, `strict`",
            "The handshake check before every collective; `strict` also compares the copies of "
            "the variables every-rank merge functions update.",
        ),
        Setting(
            "MPISTRAT_TIMEOUT",
            _seconds,
            1800.0,
            "seconds; `0`/`off` disables",
            "End the job when one collective waits this long (a rank stopped for good). Set "
            "explicitly, the waiting ranks raise `CollectiveTimeoutError` first.",
        ),
        Setting(
            "MPISTRAT_STALL_WARNING_SECONDS",
            _seconds,
            60.0,
            "seconds; `0`/`off` disables",
            "Warn once, naming the missing ranks, when a collective waits this long.",
        ),
        Setting(
            "MPISTRAT_TIMELINE",
            _directory,
            None,
            "a directory; unset or `off`: no timeline",
            "Each rank writes its collectives and `mpistrat.trace` spans there "
            "(`mpistrat timeline DIR` merges them into one trace).",
        ),
        Setting(
            "MPISTRAT_FLIGHT_RECORDS",
            _count,
            8,
            "a whole number",
            "Collectives each rank remembers and shows in stall warnings, timeouts and aborts.",
        ),
        Setting(
            "MPISTRAT_STRAGGLER_SUMMARY",
            _summary,
            "auto",
            "`auto`, `always`, `off`",
            "The end-of-job straggler summary on rank 0: when a rank was a straggler, always, or never.",
        ),
        Setting(
            "MPISTRAT_STRAGGLER_MS",
            _milliseconds,
            5.0,
            "milliseconds",
            "Mean lateness below which no rank is called a straggler.",
        ),
        Setting(
            "MPISTRAT_ABORT_ON_EXCEPTION",
            _flag,
            True,
            "`1`/`on`, `0`/`off`",
            "An uncaught exception on one rank ends the job (`MPI_Abort`).",
        ),
        Setting(
            "MPISTRAT_LOG_ALL_RANKS",
            _flag,
            False,
            "`1`/`on`, `0`/`off`",
            "Log warnings from every rank, not only rank 0.",
        ),
        Setting(
            "MPISTRAT_CUDA_AWARE",
            _optional_flag,
            None,
            "`1`, `0`, `auto`",
            "Whether MPI may be handed device pointers; `auto` (unset) asks the MPI library.",
        ),
        Setting(
            "MPISTRAT_DEVICE",
            _device,
            "auto",
            "`auto`, `gpu`, `cpu`",
            "Where a rank's arrays live; `gpu` fails every rank if one has no GPU.",
        ),
    )
}

_warned: set[tuple[str, str]] = set()


def read(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of setting ``name`` in ``env`` (default ``os.environ``), by the rule above."""
    setting = SETTINGS[name]
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return setting.default
    try:
        return setting.parse(raw)
    except ValueError as exc:
        if (name, raw) not in _warned:
            _warned.add((name, raw))
            warnings.warn(
                f"{name}={raw!r} is not {exc}; using the default, {_shown(setting.default)}",
                RuntimeWarning,
                stacklevel=2,
            )
        return setting.default


def given(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``name`` is set to a value the setting accepts (not left to its default)."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return False
    try:
        SETTINGS[name].parse(raw)
    except ValueError:
        return False
    return True


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    return f"{value:g}" if isinstance(value, float) else str(value)
