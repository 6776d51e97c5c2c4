"""Learning rate schedules, as ``keras.optimizers.schedules``: a rate as a function of the step.

An optimizer made with a schedule calls it with its ``iterations`` before each step. Each class
takes Keras 3's arguments and computes Keras's formula (in float64, where Keras computes in the
initial rate's dtype); ``get_config()`` and ``from_config()`` round-trip it, and
:func:`serialize` / :func:`deserialize` carry the class name with the config, as Keras's do.

>>> s = ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
>>> round(s(10), 6), round(s(5), 6)
(0.05, 0.070711)
>>> deserialize(serialize(s))(10) == s(10)
True
>>> CosineDecay(0.0, 100, warmup_target=0.1, warmup_steps=10)(5)
0.05
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from mpistrat.errors import InvalidArgumentError

__all__ = [
    "CosineDecay",
    "CosineDecayRestarts",
    "ExponentialDecay",
    "InverseTimeDecay",
    "LearningRateSchedule",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
    "deserialize",
    "serialize",
]


class LearningRateSchedule:
    """The base class: ``schedule(step)`` is the rate at ``step``; ``get_config()`` its arguments."""

    def __call__(self, step: int) -> float:
        raise NotImplementedError(f"{type(self).__name__} must define __call__(self, step)")

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must define get_config() to be serialisable")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LearningRateSchedule:
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, LearningRateSchedule)
            and type(other) is type(self)
            and (other.get_config() == self.get_config())
        )

    def __hash__(self) -> int:
        return hash((type(self).__name__, repr(self)))


def _number(name: str, value: Any, *, positive: bool = False, at_least: float | None = None) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and positive:
        ok = value > 0
    if ok and at_least is not None:
        ok = value >= at_least
    if not ok:
        want = (
            "a number > 0" if positive else f"a number >= {at_least}" if at_least is not None else "a number"
        )
        raise InvalidArgumentError(f"{name} must be {want}; got {value!r}")
    return float(value)


class _TimeDecay(LearningRateSchedule):
    """A rate decayed by ``step / decay_steps`` (floored with ``staircase=True``): Keras's
    ``ExponentialDecay`` and ``InverseTimeDecay`` take the same arguments."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: int,
        decay_rate: float,
        staircase: bool = False,
        name: str | None = None,
    ):
        self.initial_learning_rate = _number("initial_learning_rate", initial_learning_rate)
        self.decay_steps = _number("decay_steps", decay_steps, positive=True)
        self.decay_rate = _number("decay_rate", decay_rate, at_least=0.0)
        self.staircase, self.name = bool(staircase), name or type(self).__name__

    def _progress(self, step: int) -> float:
        p = step / self.decay_steps
        return math.floor(p) if self.staircase else p

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "decay_rate": self.decay_rate,
            "staircase": self.staircase,
            "name": self.name,
        }


class ExponentialDecay(_TimeDecay):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)`` (the exponent floored with
    ``staircase=True``)."""

    def __call__(self, step: int) -> float:
        return self.initial_learning_rate * self.decay_rate ** self._progress(step)


class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[0]`` up to ``boundaries[0]`` (inclusive), ``values[i]`` up to ``boundaries[i]``, and
    ``values[-1]`` after the last boundary (one more value than boundaries)."""

    def __init__(self, boundaries: list[int], values: list[float], name: str = "PiecewiseConstant"):
        if len(values) != len(boundaries) + 1:
            raise InvalidArgumentError(
                f"PiecewiseConstantDecay: values must have one more element than boundaries; got "
                f"{len(values)} values and {len(boundaries)} boundaries"
            )
        self.boundaries = [_number("boundaries", b) for b in boundaries]
        if any(a > b for a, b in zip(self.boundaries, self.boundaries[1:], strict=False)):
            raise InvalidArgumentError(
                f"PiecewiseConstantDecay: boundaries must not decrease; got {boundaries}"
            )
        self.values = [_number("values", v) for v in values]
        self.name = name

    def __call__(self, step: int) -> float:
        for boundary, value in zip(self.boundaries, self.values, strict=False):
            if step <= boundary:
                return value
        return self.values[-1]

    def get_config(self) -> dict[str, Any]:
        return {"boundaries": self.boundaries, "values": self.values, "name": self.name}


class PolynomialDecay(LearningRateSchedule):
    """From ``initial_learning_rate`` to ``end_learning_rate`` over ``decay_steps`` as
    ``(1 - step / decay_steps) ** power``; ``cycle=True`` restarts with a multiple of
    ``decay_steps`` instead of staying at the end."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: int,
        end_learning_rate: float = 0.0001,
        power: float = 1.0,
        cycle: bool = False,
        name: str = "PolynomialDecay",
    ):
        self.initial_learning_rate = _number("initial_learning_rate", initial_learning_rate)
        self.decay_steps = _number("decay_steps", decay_steps, positive=True)
        self.end_learning_rate = _number("end_learning_rate", end_learning_rate)
        self.power = _number("power", power)
        self.cycle, self.name = bool(cycle), name

    def __call__(self, step: int) -> float:
        steps = self.decay_steps
        if self.cycle:
            steps *= 1.0 if step == 0 else math.ceil(step / self.decay_steps)
        else:
            step = min(step, steps)  # type: ignore[assignment]
        p = step / steps
        return (self.initial_learning_rate - self.end_learning_rate) * (
            1 - p
        ) ** self.power + self.end_learning_rate

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "end_learning_rate": self.end_learning_rate,
            "power": self.power,
            "cycle": self.cycle,
            "name": self.name,
        }


class InverseTimeDecay(_TimeDecay):
    """``initial_learning_rate / (1 + decay_rate * step / decay_steps)`` (floored with ``staircase``)."""

    def __call__(self, step: int) -> float:
        return self.initial_learning_rate / (1.0 + self.decay_rate * self._progress(step))


def _cosine(fraction: float, alpha: float) -> float:
    return (1 - alpha) * 0.5 * (1.0 + math.cos(math.pi * fraction)) + alpha


class CosineDecay(LearningRateSchedule):
    """Cosine decay over ``decay_steps`` to ``alpha`` times the rate, after an optional linear warmup
    from ``initial_learning_rate`` to ``warmup_target`` over ``warmup_steps``."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: int,
        alpha: float = 0.0,
        name: str = "CosineDecay",
        warmup_target: float | None = None,
        warmup_steps: int = 0,
    ):
        self.initial_learning_rate = _number("initial_learning_rate", initial_learning_rate)
        self.decay_steps = _number("decay_steps", decay_steps, positive=True)
        self.alpha = _number("alpha", alpha)
        self.name = name
        self.warmup_target = None if warmup_target is None else _number("warmup_target", warmup_target)
        self.warmup_steps = _number("warmup_steps", warmup_steps, at_least=0.0)

    def __call__(self, step: int) -> float:
        if self.warmup_target is None:
            return self.initial_learning_rate * _cosine(
                min(step, self.decay_steps) / self.decay_steps, self.alpha
            )
        step = min(step, self.decay_steps + self.warmup_steps)  # type: ignore[assignment]
        if step < self.warmup_steps:
            delta = self.warmup_target - self.initial_learning_rate
            return delta * (step / self.warmup_steps) + self.initial_learning_rate
        fraction = (step - self.warmup_steps) / self.decay_steps
        return self.warmup_target * _cosine(fraction, self.alpha)

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "alpha": self.alpha,
            "name": self.name,
            "warmup_target": self.warmup_target,
            "warmup_steps": self.warmup_steps,
        }


class CosineDecayRestarts(LearningRateSchedule):
    """Cosine decay with warm restarts (SGDR): the first period is ``first_decay_steps``, each next
    ``t_mul`` times longer, its peak ``m_mul`` times the last."""

    def __init__(
        self,
        initial_learning_rate: float,
        first_decay_steps: int,
        t_mul: float = 2.0,
        m_mul: float = 1.0,
        alpha: float = 0.0,
        name: str = "SGDRDecay",
    ):
        self.initial_learning_rate = _number("initial_learning_rate", initial_learning_rate)
        self.first_decay_steps = _number("first_decay_steps", first_decay_steps, positive=True)
        self.t_mul = _number("t_mul", t_mul, positive=True)
        self.m_mul = _number("m_mul", m_mul, at_least=0.0)
        self.alpha = _number("alpha", alpha)
        self.name = name

    def __call__(self, step: int) -> float:
        fraction = step / self.first_decay_steps
        if self.t_mul == 1.0:
            restart = math.floor(fraction)
            fraction -= restart
        else:
            restart = math.floor(math.log(1.0 - fraction * (1.0 - self.t_mul)) / math.log(self.t_mul))
            done = (1.0 - self.t_mul**restart) / (1.0 - self.t_mul)
            fraction = (fraction - done) / self.t_mul**restart
        decayed = 0.5 * self.m_mul**restart * (1.0 + math.cos(math.pi * fraction))
        return self.initial_learning_rate * ((1 - self.alpha) * decayed + self.alpha)

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "first_decay_steps": self.first_decay_steps,
            "t_mul": self.t_mul,
            "m_mul": self.m_mul,
            "alpha": self.alpha,
            "name": self.name,
        }


_CLASSES = {
    cls.__name__: cls
    for cls in (
        ExponentialDecay,
        PiecewiseConstantDecay,
        PolynomialDecay,
        InverseTimeDecay,
        CosineDecay,
        CosineDecayRestarts,
    )
}


def serialize(schedule: LearningRateSchedule) -> dict[str, Any]:
    """``{"class_name": ..., "config": ...}``, as ``keras.optimizers.schedules.serialize`` gives."""
    if not isinstance(schedule, LearningRateSchedule):
        raise InvalidArgumentError(
            f"serialize: expected a LearningRateSchedule; got {type(schedule).__name__}"
        )
    return {"class_name": type(schedule).__name__, "config": schedule.get_config()}


def deserialize(
    config: dict[str, Any], custom_objects: dict[str, type[LearningRateSchedule]] | None = None
) -> LearningRateSchedule:
    """The schedule :func:`serialize` described (``custom_objects``: classes of your own, by name)."""
    classes: dict[str, type[LearningRateSchedule]] = {**_CLASSES, **(custom_objects or {})}
    name = config.get("class_name") if isinstance(config, dict) else None
    if name not in classes:
        raise InvalidArgumentError(
            f"deserialize: unknown schedule {name!r}; expected one of {sorted(classes)} (pass your own "
            "classes as custom_objects)"
        )
    return classes[name].from_config(dict(config.get("config", {})))
