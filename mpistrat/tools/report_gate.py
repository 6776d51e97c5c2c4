"""``mpistrat report --reference``: the regression gate, rows against a reference run's.

Rows match on (op, size, ranks, dtype). A row whose time (the mean, or ``--metric``) exceeds
the reference's by more than ``--tolerance`` is a regression, named with both numbers. The
gate fails (exit 1) on a regression, and when no row matched (nothing was checked); a time
that is no measurement (NaN, infinite, zero or negative: a broken or failed run) cannot be
compared and is an error naming the row (exit 2), as is a tolerance that is not a finite
fraction >= 0. Either way the verdict is one line, with how many rows were compared and
which were missing on either side.

>>> key = ("all_reduce", 4, 2, "float32")
>>> gate({key: 20.0}, {key: 10.0}, 0.10).slower
[(('all_reduce', 4, 2, 'float32'), 20.0, 10.0)]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from mpistrat.errors import InvalidArgumentError
from mpistrat.tools.bench_report import human

__all__ = ["METRICS", "Gate", "Key", "checked_tolerance", "gate", "key", "name", "times", "verdict"]

Key = tuple[str, int, int, str]  # op, bytes, ranks, dtype
METRICS = {"mean": "avg", "p50": "p50", "p99": "p99"}


def key(row: dict[str, Any]) -> Key:
    return (row["op"], int(row["bytes"]), int(row["ranks"]), str(row["dtype"]))


def name(k: Key) -> str:
    op, nbytes, ranks, dtype = k
    return f"{op} {human(nbytes)} {dtype} at {ranks} rank{'s' if ranks != 1 else ''}"


@dataclasses.dataclass
class Gate:
    """The regression gate's findings: rows compared, slower ones (key, now, reference), missing ones."""

    compared: int
    slower: list[tuple[Key, float, float]]
    only_here: list[Key]
    only_in_reference: list[Key]

    @property
    def passed(self) -> bool:
        """No row slower, and at least one compared: a gate that matched nothing has checked nothing."""
        return self.compared > 0 and not self.slower


def gate(now: dict[Key, float], reference: dict[Key, float], tolerance: float) -> Gate:
    """Rows of ``now`` slower than ``reference``'s by more than ``tolerance`` (0.10: 10 %)."""
    common = [k for k in now if k in reference]
    slower = [(k, now[k], reference[k]) for k in common if now[k] > reference[k] * (1 + tolerance)]
    return Gate(
        compared=len(common),
        slower=slower,
        only_here=[k for k in now if k not in reference],
        only_in_reference=[k for k in reference if k not in now],
    )


def checked_tolerance(tolerance: float) -> float:
    """``tolerance``, or ``InvalidArgumentError``: NaN compares false and would pass every row."""
    if not math.isfinite(tolerance) or tolerance < 0:
        raise InvalidArgumentError(
            f"--tolerance: expected a finite fraction >= 0 (0.10 is 10%); got {tolerance}"
        )
    return tolerance


def times(runs: Iterable[tuple[str, dict[str, Any]]], metric: str) -> dict[Key, float]:
    """Each (op, size, ranks, dtype)'s time in ``metric``; a row in several files counts as their mean.

    A time that is no measurement is an ``InvalidArgumentError`` naming the file and the row.
    """
    stat = METRICS[metric]
    found: dict[Key, list[float]] = {}
    for path, run in runs:
        for r in run["results"]:
            value = r["mpistrat"]["time_us"].get(stat)
            if value is None:
                raise InvalidArgumentError(
                    f"{path}: {name(key(r))} has no {metric} (too few iterations, or an older file); "
                    "choose another --metric"
                )
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise InvalidArgumentError(
                    f"{path}: {name(key(r))} has a {metric} time of {value:g} us; the gate compares times "
                    "that are finite numbers > 0 (this one is a failed or broken measurement: run it again)"
                )
            found.setdefault(key(r), []).append(float(value))
    return {k: sum(v) / len(v) for k, v in found.items()}


def verdict(result: Gate, references: list[str], metric: str, tolerance: float) -> str:
    """What the gate says: each slower row, the missing ones, then one line: passed or FAILED."""
    lines = []
    for k, now, was in result.slower:
        lines.append(
            f"SLOWER: {name(k)}: {now:.2f} us against {was:.2f} us in the reference "
            f"({now / was:.2f}x, more than {1 + tolerance:.2f}x)"
        )
    for label, keys in (
        ("not in the reference", result.only_here),
        ("only in the reference", result.only_in_reference),
    ):
        if keys:
            shown = "; ".join(name(k) for k in keys[:20]) + (
                f"; and {len(keys) - 20} more" if len(keys) > 20 else ""
            )
            lines.append(f"missing: {len(keys)} row(s) {label}: {shown}")
    against = f"on {metric} time against {', '.join(references)} (tolerance {tolerance:.0%})"
    if result.compared == 0:
        lines.append(
            f"gate FAILED: no row matched on (op, size, ranks, dtype), so nothing was compared {against}"
        )
    else:
        state = "passed" if result.passed else "FAILED"
        lines.append(
            f"gate {state}: {result.compared} row(s) compared {against}; {len(result.slower)} slower"
        )
    return "\n".join(lines)
