"""An optimizer's learning rate: a number held in a variable, or a schedule of the step.

A number lives in a plain float64 variable (``<optimizer>/learning_rate``), written in place
when it is set, so the next step reads it and a checkpoint saves it, as Keras tracks it. A
schedule (a callable of the step, a :mod:`~mpistrat.training.schedules` one serialisable) is
called with ``iterations`` before each step. What a step applies must be a finite number: the
step raises the error :meth:`LearningRate.at` returns on every rank.

>>> rate = LearningRate(0.1, "SGD")
>>> rate.set(0.01); rate.at(3)
(0.01, None)
>>> print(LearningRate(lambda step: float("nan"), "SGD").at(2)[1])
SGD: learning_rate at step 2 must be a finite number (or a schedule returning one); got nan
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from mpistrat.errors import InvalidArgumentError
from mpistrat.training import schedules
from mpistrat.training.variables import Variable, Writable, plain_variable

__all__ = ["LearningRate", "checked_rate"]


class LearningRate:
    """The rate of optimizer ``name``: ``variable`` (a number's) or ``schedule``."""

    def __init__(self, value: float | Callable[[int], float], name: str):
        self.name = name
        self.variable: Variable | None = None
        self.schedule: Callable[[int], float] | None = None
        if callable(value):
            self.schedule = value
        else:
            self.variable = plain_variable(
                np.array(checked_rate(value, name), np.float64), f"{name}/learning_rate"
            )

    def read(self, step: int) -> Variable | float:
        """What ``optimizer.learning_rate`` reads: the variable, or the schedule's value at ``step``."""
        if self.variable is not None:
            return self.variable
        assert self.schedule is not None
        return self.schedule(step)

    def set(self, value: float | Callable[[int], float]) -> None:
        """A schedule replaces the rate; a number is written into the variable (not into a schedule)."""
        if callable(value):
            self.schedule, self.variable = value, None
            return
        if self.variable is None:
            raise InvalidArgumentError(
                f"{self.name}: this optimizer was made with a schedule as its learning_rate, so its rate "
                f"is not settable to a number (got {value!r}); set another schedule, or make the optimizer "
                "with a number to set it by hand"
            )
        with Writable(self.variable) as held:
            held[...] = checked_rate(value, self.name)

    def at(self, step: int) -> tuple[float, InvalidArgumentError | None]:
        """The rate step ``step`` applies, and the error that stops it (not a finite number)."""
        if self.variable is not None:
            value = self.variable.local_array
        else:
            assert self.schedule is not None
            value = self.schedule(step)
        try:
            return checked_rate(value, self.name, f"at step {step}"), None
        except InvalidArgumentError as exc:
            return math.nan, exc

    def config(self) -> Any:
        """As Keras's optimizer config has it: the number, or the schedule serialised."""
        if self.variable is not None:
            return float(self.variable.local_array)
        if isinstance(self.schedule, schedules.LearningRateSchedule):
            return schedules.serialize(self.schedule)
        raise InvalidArgumentError(
            f"{self.name}.get_config: the learning rate is a plain callable ({self.schedule!r}), which has "
            "no config; use a schedule of mpistrat.optimizers.schedules (or a subclass with get_config)"
        )


def checked_rate(value: Any, name: str, where: str = "") -> float:
    """A learning rate as a float: a finite real number, else an error naming what came."""
    if isinstance(value, Variable):
        value = value.local_array
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, (bool, np.bool_))
    if ok and math.isfinite(value):
        return float(value)
    got = f"a {type(value).__name__}" if not ok else repr(float(value))
    raise InvalidArgumentError(
        f"{name}: learning_rate{' ' + where if where else ''} must be a finite number (or a schedule "
        f"returning one); got {got}"
    )
