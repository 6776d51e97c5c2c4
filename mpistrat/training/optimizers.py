"""Optimizers that update distributed variables the tf.distribute way, in one fused step.

``SGD``, ``Adam`` (``amsgrad``), ``AdamW``, ``RMSprop`` (``momentum``, ``centered``),
``Adagrad`` and ``Lamb`` compute Keras 3's arithmetic, each as an in-place update of flat
1-D blocks (``_update_flat``), so that every one keeps its state in flat buffers and shards
with ``shard_state=True``. Each takes Keras's base arguments (``weight_decay``, ``clipnorm``,
``clipvalue``, ``global_clipnorm``, ``use_ema``, ``ema_momentum``, ``ema_overwrite_frequency``,
``loss_scale_factor``, ``gradient_accumulation_steps``) as keywords: see
:class:`~mpistrat.training.optimizer_base.Optimizer`. ``LossScaleOptimizer`` wraps one with a
dynamic loss scale; ``schedules`` holds Keras's learning rate schedules.

>>> import mpistrat, numpy as np
>>> w = mpistrat.Variable(np.array([1.0, 2.0]))
>>> opt = mpistrat.optimizers.SGD(learning_rate=0.5)
>>> _ = opt.apply_gradients([(np.array([1.0, 1.0]), w)])
>>> w.numpy(), int(opt.iterations.numpy())
(array([0.5, 1.5]), 1)
>>> adam = mpistrat.optimizers.Adam(0.1, shard_state=True)
>>> _ = adam.apply_gradients([(np.array([1.0, -1.0]), w)])
>>> w.numpy().round(3), adam.get_slot(w, "m").numpy()
(array([0.4, 1.6]), array([ 0.1, -0.1]))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from mpistrat.comm import packing
from mpistrat.errors import InvalidArgumentError
from mpistrat.training import placement, schedules
from mpistrat.training.loss_scale import LossScaleOptimizer
from mpistrat.training.optimizer_base import Optimizer
from mpistrat.training.sharded_slot import ShardedSlot

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "Lamb",
    "LossScaleOptimizer",
    "Optimizer",
    "RMSprop",
    "ShardedSlot",
    "schedules",
]

Rate = float | Callable[[int], float]


class SGD(Optimizer):
    """Gradient descent with optional (Nesterov) momentum, as ``keras.optimizers.SGD``.

    ``velocity = momentum * velocity - lr * g``; ``w += velocity`` (Nesterov:
    ``w += momentum * velocity - lr * g``); plain ``w -= lr * g`` when momentum is 0.
    ``**base``: Keras's base arguments and mpistrat's (see :class:`Optimizer`).
    """

    _config_names = ("momentum", "nesterov")

    def __init__(
        self,
        learning_rate: Rate = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        name: str = "SGD",
        **base: Any,
    ):
        self.momentum = _fraction(name, "momentum", momentum, closed=True)
        self.nesterov = bool(nesterov)
        self.slot_names = ("momentum",) if momentum else ()
        super().__init__(learning_rate, name, **base)

    def _update_flat(self, w: Any, g: Any, slots: list[Any], lr: float, step: int) -> None:
        # In place, as a hand-written NumPy update would be, with g as the only temporary.
        g *= lr
        if not slots:
            w -= g
            return
        (velocity,) = slots
        velocity *= self.momentum
        velocity -= g
        if self.nesterov:  # w += momentum * velocity - lr * g
            w -= g
            packing.array_module(w).multiply(velocity, self.momentum, out=g)
            w += g
        else:
            w += velocity


class Adam(Optimizer):
    """Adam, as ``keras.optimizers.Adam`` (bias correction folded into the step size).

    With ``t = step + 1``: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``w -= lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + epsilon)``; ``amsgrad=True`` divides
    by the largest ``v`` so far instead (the slot ``vhat``).
    """

    _config_names = ("beta_1", "beta_2", "epsilon", "amsgrad")

    def __init__(
        self,
        learning_rate: Rate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        name: str = "Adam",
        **base: Any,
    ):
        self.beta_1 = _fraction(name, "beta_1", beta_1)
        self.beta_2 = _fraction(name, "beta_2", beta_2)
        self.epsilon = _positive(name, "epsilon", epsilon)
        if not isinstance(amsgrad, bool):  # Adam(lr, b1, b2, eps, "name") before amsgrad came fifth
            raise InvalidArgumentError(
                f"{name}: amsgrad must be True or False; got {amsgrad!r} (the name follows it, as in Keras: "
                "pass name= by keyword)"
            )
        self.amsgrad = amsgrad
        self.slot_names = ("m", "v", "vhat") if amsgrad else ("m", "v")
        super().__init__(learning_rate, name, **base)

    def _update_flat(self, w: Any, g: Any, slots: list[Any], lr: float, step: int) -> None:
        # In place, with g as the only temporary: 12 passes, no buffer of its own.
        m, v = slots[0], slots[1]
        t = step + 1
        b1, b2 = self.beta_1, self.beta_2
        lr_t = lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        xp = packing.array_module(w)
        # Sums of like-signed terms only: g + b1 (m - g) would lose float32 digits to cancellation.
        m *= b1  # m = b1 m + (1 - b1) g
        g *= 1.0 - b1
        m += g
        xp.square(g, out=g)  # v = b2 v + (1 - b2) g^2, from ((1 - b1) g)^2
        g *= (1.0 - b2) / (1.0 - b1) ** 2
        v *= b2
        v += g
        if self.amsgrad:
            v = xp.maximum(slots[2], v, out=slots[2])
        xp.sqrt(v, out=g)  # w -= lr_t m / (sqrt(v) + epsilon)
        g += self.epsilon
        xp.divide(m, g, out=g)
        g *= lr_t
        w -= g


class AdamW(Adam):
    """Adam with decoupled weight decay, as ``keras.optimizers.AdamW``: ``w -= w * weight_decay * lr``
    before each Adam update (``weight_decay`` 0.004 by default; exclude variables with
    :meth:`~Optimizer.exclude_from_weight_decay`)."""

    def __init__(
        self,
        learning_rate: Rate = 0.001,
        weight_decay: float = 0.004,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        name: str = "AdamW",
        **base: Any,
    ):
        if weight_decay is None:
            raise InvalidArgumentError(
                f"{name}: weight_decay must be a number >= 0 (AdamW's decay); got None"
            )
        super().__init__(
            learning_rate, beta_1, beta_2, epsilon, amsgrad, name, weight_decay=weight_decay, **base
        )


class RMSprop(Optimizer):
    """RMSprop, as ``keras.optimizers.RMSprop``.

    ``velocity = rho velocity + (1 - rho) g^2``; centered, also ``average_gradient = rho a +
    (1 - rho) g`` and the denominator ``velocity - a^2``; ``increment = lr g / sqrt(denominator +
    epsilon)``; with momentum, ``momentum = momentum_coefficient * momentum + increment`` and
    ``w -= momentum``, else ``w -= increment``.
    """

    _config_names = ("rho", "momentum", "epsilon", "centered")

    def __init__(
        self,
        learning_rate: Rate = 0.001,
        rho: float = 0.9,
        momentum: float = 0.0,
        epsilon: float = 1e-7,
        centered: bool = False,
        name: str = "RMSprop",
        **base: Any,
    ):
        self.rho = _fraction(name, "rho", rho, closed=True)
        self.momentum = _fraction(name, "momentum", momentum, closed=True)
        self.epsilon = _positive(name, "epsilon", epsilon)
        self.centered = bool(centered)
        self.slot_names = (
            "velocity",
            *(("momentum",) if momentum else ()),
            *(("average_gradient",) if centered else ()),
        )
        super().__init__(learning_rate, name, **base)

    def _update_flat(self, w: Any, g: Any, slots: list[Any], lr: float, step: int) -> None:
        xp, rho = packing.array_module(w), self.rho
        velocity = slots[0]
        tmp = xp.square(g, out=placement.empty_like(g))  # velocity = rho velocity + (1 - rho) g^2
        tmp *= 1 - rho
        velocity *= rho
        velocity += tmp
        if self.centered:  # average = rho average + (1 - rho) g; denominator velocity - average^2
            average = slots[-1]
            xp.multiply(g, 1 - rho, out=tmp)
            average *= rho
            average += tmp
            xp.square(average, out=tmp)
            xp.subtract(velocity, tmp, out=tmp)
            tmp += self.epsilon
        else:
            xp.add(velocity, self.epsilon, out=tmp)
        xp.sqrt(tmp, out=tmp)
        g *= lr  # increment = lr g / sqrt(denominator)
        g /= tmp
        if self.momentum:
            momentum = slots[1]
            momentum *= self.momentum
            momentum += g
            w -= momentum
        else:
            w -= g


class Adagrad(Optimizer):
    """Adagrad, as ``keras.optimizers.Adagrad``: ``accumulator += g^2`` (from
    ``initial_accumulator_value``); ``w -= lr g / sqrt(accumulator + epsilon)``."""

    _config_names = ("initial_accumulator_value", "epsilon")

    slot_names = ("accumulator",)

    def __init__(
        self,
        learning_rate: Rate = 0.001,
        initial_accumulator_value: float = 0.1,
        epsilon: float = 1e-7,
        name: str = "Adagrad",
        **base: Any,
    ):
        value = initial_accumulator_value
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value >= 0)
        ):
            raise InvalidArgumentError(
                f"{name}: initial_accumulator_value must be a number >= 0; got {value!r}"
            )
        self.initial_accumulator_value = float(value)
        self.epsilon = _positive(name, "epsilon", epsilon)
        super().__init__(learning_rate, name, **base)

    def _slot_initial(self, slot_name: str) -> float:
        return self.initial_accumulator_value if slot_name == "accumulator" else 0.0

    def _update_flat(self, w: Any, g: Any, slots: list[Any], lr: float, step: int) -> None:
        xp = packing.array_module(w)
        (accumulator,) = slots
        tmp = xp.square(g, out=placement.empty_like(g))
        accumulator += tmp
        xp.add(accumulator, self.epsilon, out=tmp)
        xp.sqrt(tmp, out=tmp)
        g *= lr
        g /= tmp
        w -= g


class Lamb(Optimizer):
    """LAMB, as ``keras.optimizers.Lamb``: Adam's direction ``u = m_hat / (sqrt(v_hat) + epsilon)``,
    applied per variable with the trust ratio ``||w|| / ||u||`` (1 when either norm is 0):
    ``w -= ratio * lr * u``.

    The norms are over whole variables: sharded, each rank sums the squares of its elements of
    each variable, and one all-reduce of that vector (two float64 per variable) gives every rank
    every ratio.
    """

    _config_names = ("beta_1", "beta_2", "epsilon")

    slot_names = ("m", "v")
    trust_ratio = True

    def __init__(
        self,
        learning_rate: Rate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        name: str = "Lamb",
        **base: Any,
    ):
        self.beta_1 = _fraction(name, "beta_1", beta_1)
        self.beta_2 = _fraction(name, "beta_2", beta_2)
        self.epsilon = _positive(name, "epsilon", epsilon)
        super().__init__(learning_rate, name, **base)

    def _update_flat(self, w: Any, g: Any, slots: list[Any], lr: float, step: int) -> None:
        """Updates ``m`` and ``v`` and leaves the direction in ``g``: the step applies it."""
        xp, (m, v) = packing.array_module(w), slots
        t = step + 1
        b1, b2 = self.beta_1, self.beta_2
        tmp = xp.square(g, out=placement.empty_like(g))  # v = b2 v + (1 - b2) g^2
        tmp *= 1.0 - b2
        v *= b2
        v += tmp
        m *= b1  # m = b1 m + (1 - b1) g
        g *= 1.0 - b1
        m += g
        xp.divide(m, 1.0 - b1**t, out=g)  # u = m_hat / (sqrt(v_hat) + epsilon)
        xp.divide(v, 1.0 - b2**t, out=tmp)
        xp.sqrt(tmp, out=tmp)
        tmp += self.epsilon
        g /= tmp


def _fraction(name: str, what: str, value: Any, closed: bool = False) -> float:
    """``value`` in [0, 1) ([0, 1] when ``closed``) as a float, else an error naming it."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and value >= 0.0 and (value <= 1.0 if closed else value < 1.0)):
        raise InvalidArgumentError(f"{name}: {what} must be in [0, 1{']' if closed else ')'}; got {value!r}")
    return float(value)


def _positive(name: str, what: str, value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and value > 0):
        raise InvalidArgumentError(f"{name}: {what} must be a number > 0; got {value!r}")
    return float(value)
