"""Gradient accumulation: K-1 of every K ``apply_gradients`` calls add locally and move nothing.

``Optimizer(..., gradient_accumulation_steps=K)`` hands each call's gradients to an
:class:`Accumulator`. On calls 1 to K-1 of a cycle it adds them, per variable, into this
rank's sums (no MPI call at all); on the K-th it returns ``(sum + g) / K`` for each
variable, as Keras 3 computes it, and the optimizer reduces and applies that once.

Bad input found on a quiet call (a different set of variables, a gradient of the wrong
shape) cannot be raised there on one rank alone without stranding the others at the next
reduction, so it is kept and raised on every rank by the K-th call's handshake.

>>> import mpistrat, numpy as np
>>> acc = Accumulator(3, "SGD")
>>> w = mpistrat.Variable(np.zeros(1))
>>> acc.add([np.array([1.0])], [w]), acc.add([np.array([2.0])], [w])
(None, None)
>>> acc.add([np.array([6.0])], [w])
[array([3.])]
"""

from __future__ import annotations

import numbers
from typing import Any

from mpistrat.comm import packing
from mpistrat.errors import InvalidArgumentError, MpistratError

__all__ = ["Accumulator", "checked_steps"]


def checked_steps(steps: Any, name: str) -> int | None:
    """``gradient_accumulation_steps`` as an int >= 1 (None: off); anything else is an error."""
    if steps is None:
        return None
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise InvalidArgumentError(
            f"{name}: gradient_accumulation_steps must be a positive integer (or None for no "
            f"accumulation); got {steps!r}"
        )
    return int(steps)


class Accumulator:
    """This rank's running sums of one optimizer's gradients over a cycle of ``steps`` calls."""

    def __init__(self, steps: int, name: str):
        self.steps, self._name = steps, name
        self.count = 0  # calls of the current cycle so far
        self._sums: list[Any] = []
        self._keys: tuple[int, ...] = ()
        self.pending: MpistratError | None = None  # bad input of a quiet call, raised at the K-th

    def add(self, grads: list[Any], variables: list[Any]) -> list[Any] | None:
        """Add one call's gradients; None on a quiet call, the K gradients' means on the K-th."""
        try:
            self._add(grads, variables)
        except MpistratError as exc:  # a gradient that is no array: kept, as any bad input
            self._keep(exc)
        self.count += 1
        if self.count < self.steps:
            return None
        means = self._sums
        for total in means:
            total /= self.steps
        self.count, self._sums, self._keys = 0, [], ()
        return means

    def _add(self, grads: list[Any], variables: list[Any]) -> None:
        keys = tuple(map(id, variables))
        if self.count == 0:
            self._keys = keys
            self._sums = [self._fresh(g, v) for g, v in zip(grads, variables, strict=True)]
        elif keys != self._keys:
            self._keep(
                InvalidArgumentError(
                    f"{self._name}.apply_gradients: call {self.count + 1} of {self.steps} of an accumulation "
                    "cycle gives gradients for other variables (or in another order) than its first call; "
                    "give every call of a cycle the same variables in the same order"
                )
            )
        else:
            for total, grad, var in zip(self._sums, grads, variables, strict=True):
                if type(grad) is not type(total):
                    grad = packing.as_array(
                        grad, f"{self._name}.apply_gradients: the gradient of {var.name!r}"
                    )
                if grad.shape != total.shape:
                    self._keep(_bad_shape(self._name, grad, var))
                else:
                    total += grad

    def take_pending(self) -> MpistratError | None:
        error, self.pending = self.pending, None
        return error

    def _fresh(self, grad: Any, var: Any) -> Any:
        local = getattr(var, "_local_variable", None)
        target = (var if local is None else local())._value
        grad = packing.as_array(grad, f"{self._name}.apply_gradients: the gradient of {var.name!r}")
        if grad.shape != target.shape:
            self._keep(_bad_shape(self._name, grad, var))
            return packing.array_module(target).zeros(target.shape, target.dtype)
        return grad.astype(target.dtype, copy=True)

    def _keep(self, error: MpistratError) -> None:
        if self.pending is None:
            self.pending = error


def _bad_shape(name: str, grad: Any, var: Any) -> InvalidArgumentError:
    shape = tuple(getattr(grad, "shape", ()))
    return InvalidArgumentError(
        f"{name}.apply_gradients: the gradient of {var.name!r} has shape {shape}; "
        f"expected the variable's shape {tuple(var.shape)} (gradients are not broadcast)"
    )
