"""``LossScaleOptimizer``: a dynamic loss scale around an optimizer, as Keras 3's.

Mixed precision (float16 gradients) underflows small gradients; scaling the loss by a large
factor keeps them representable. The wrapped step divides the summed gradient by the scale. A
step whose summed gradient holds an inf or a NaN (on any rank) is skipped on every rank alike,
nothing written, and the scale halves; after ``dynamic_growth_steps`` applied steps in a row
it doubles. The scale and the count of steps since it last changed are variables: a
checkpoint saves and restores them, and a recovery after a rank's death gives every survivor
those of the survivor the others go on from.

>>> import mpistrat, numpy as np
>>> from mpistrat.optimizers import SGD
>>> opt = LossScaleOptimizer(SGD(0.5), initial_scale=4.0, dynamic_growth_steps=2)
>>> w = mpistrat.Variable(np.array([1.0]))
>>> _ = opt.apply_gradients([(np.array([np.inf]), w)])   # skipped: the scale halves
>>> float(opt.dynamic_scale.numpy()), w.numpy(), int(opt.iterations.numpy())
(2.0, array([1.]), 0)
>>> _ = opt.apply_gradients([(opt.scale_loss(1.0) * np.ones(1), w)])  # a gradient of 1, scaled by 2
>>> w.numpy(), int(opt.iterations.numpy())
(array([0.5]), 1)
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from mpistrat.errors import InvalidArgumentError
from mpistrat.interface import modes
from mpistrat.training.optimizer_base import Optimizer
from mpistrat.training.recovery import broadcast_in_place
from mpistrat.training.variables import Variable, Writable, plain_variable
from mpistrat.values import local_variable

__all__ = ["LossScaleOptimizer"]


class LossScaleOptimizer:
    """Wraps ``inner_optimizer`` with a dynamic loss scale (Keras 3's ``LossScaleOptimizer``).

    Multiply the loss by :meth:`scale_loss` (or ``dynamic_scale``) before differentiating; pass
    the scaled gradients to :meth:`apply_gradients`. Everything else (``learning_rate``,
    ``iterations``, slots, ``variables()``) is the inner optimizer's.

    Args:
        inner_optimizer: the optimizer that applies the unscaled gradients.
        initial_scale: the first scale (2**15).
        dynamic_growth_steps: applied steps in a row after which the scale doubles (2000).
    """

    def __init__(
        self, inner_optimizer: Optimizer, initial_scale: float = 2.0**15, dynamic_growth_steps: int = 2000
    ):
        if not isinstance(inner_optimizer, Optimizer):
            raise InvalidArgumentError(
                "LossScaleOptimizer: inner_optimizer must be an mpistrat optimizer; got "
                f"{type(inner_optimizer).__name__}"
            )
        if inner_optimizer.loss_scale_factor is not None:
            raise InvalidArgumentError(
                "LossScaleOptimizer: the inner optimizer has a loss_scale_factor of its own; a dynamic scale "
                "replaces it: make the inner optimizer without one"
            )
        scale = initial_scale
        if (
            isinstance(scale, bool)
            or not isinstance(scale, numbers.Real)
            or not (math.isfinite(scale) and scale > 0)
        ):
            raise InvalidArgumentError(
                f"LossScaleOptimizer: initial_scale must be a number > 0; got {scale!r}"
            )
        steps = dynamic_growth_steps
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise InvalidArgumentError(
                f"LossScaleOptimizer: dynamic_growth_steps must be an integer >= 1; got {steps!r}"
            )
        self.inner_optimizer: Optimizer = inner_optimizer
        self.initial_scale: float = float(scale)
        self.dynamic_growth_steps: int = int(steps)
        name = inner_optimizer.name
        # Plain on every rank: every rank applies the same agreed steps, so every rank counts the same.
        scale_name, counter_name = f"{name}/loss_scale/dynamic_scale", f"{name}/loss_scale/step_counter"
        self._scale: Variable = plain_variable(np.array(self.initial_scale), scale_name)
        self._counter: Variable = plain_variable(np.zeros((), np.int64), counter_name)
        self._registered: bool = False  # with the strategy's recovery (at the first step)

    @property
    def dynamic_scale(self) -> Variable:
        """The current loss scale (a float64 variable)."""
        return self._scale

    @property
    def step_counter(self) -> Variable:
        """Applied steps since the scale last changed."""
        return self._counter

    def scale_loss(self, loss: Any) -> Any:
        """``loss`` times the current scale."""
        return loss * float(self._scale.local_array)

    def apply_gradients(self, grads_and_vars: Any) -> Variable:
        """One step of the inner optimizer from the scaled gradients: skipped on every rank when their
        sum is not finite (the scale halves), else applied (the scale doubles after
        ``dynamic_growth_steps`` applied steps)."""
        scale = float(self._scale.local_array)
        if not self._registered:  # every rank at its first step (in strategy.run), in the same order
            modes.get_strategy().extended.collectives.recoverables.add(self)
            self._registered = True
        applied = self.inner_optimizer._apply(grads_and_vars, scale)
        if applied is not None:
            counter = local_variable(self._counter)
            with Writable(self._scale) as held_scale, Writable(counter) as count:
                if not applied:
                    held_scale[...] = scale / 2.0
                    count[...] = 0
                elif int(count) + 1 >= self.dynamic_growth_steps:
                    held_scale[...] = scale * 2.0
                    count[...] = 0
                else:
                    count += 1
        return self.iterations

    def recovery_facts(self) -> None:  # for a recovery after a rank's death (collectives/recoverables.py)
        return None

    def recover(self, recovery: Any, facts: list[Any]) -> None:
        """After a rank's death: the scale and its counter of ``recovery.source`` (collective over the
        survivors), which counted the step the others go on from."""
        for var in (self._scale, self._counter):
            with Writable(var) as held:
                broadcast_in_place(recovery.collectives.comm, held, recovery.source)

    # -- the inner optimizer's --------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.inner_optimizer.name

    @property
    def iterations(self) -> Variable:
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        self.inner_optimizer.learning_rate = value

    def build(self, var_list: list[Variable]) -> None:
        self.inner_optimizer.build(var_list)

    def get_slot(self, var: Variable, slot_name: str) -> Any:
        return self.inner_optimizer.get_slot(var, slot_name)

    def variables(self) -> list[Any]:
        """The inner optimizer's variables, then the scale and its counter."""
        return [*self.inner_optimizer.variables(), self._scale, self._counter]

    def tracked(self) -> dict[str, Variable]:
        """The variables a checkpoint saves besides slots: the inner's, the scale and its counter."""
        return {**self.inner_optimizer.tracked(), "loss_scale/dynamic_scale": self._scale,
                "loss_scale/step_counter": self._counter}  # fmt: skip

    def slots_by_variable(self) -> list[tuple[Variable, dict[str, Any]]]:
        return self.inner_optimizer.slots_by_variable()

    @property
    def gradient_accumulation_steps(self) -> int | None:
        return self.inner_optimizer.gradient_accumulation_steps

    def accumulation_state(self) -> Any:
        return self.inner_optimizer.accumulation_state()

    def prepare_accumulation(self, var_list: list[Variable] | None) -> None:
        self.inner_optimizer.prepare_accumulation(var_list)

    def finalize_variable_values(self, var_list: Any = None) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)
