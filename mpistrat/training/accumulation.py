"""Gradient accumulation: K-1 of every K ``apply_gradients`` calls add locally and move nothing.

``Optimizer(..., gradient_accumulation_steps=K)`` hands each call's gradients to an
:class:`Accumulator`. On calls 1 to K-1 of a cycle it keeps them in this rank's buffers (no
MPI call at all); on the K-th it hands them to the optimizer, which reduces once and
applies their mean. Two kinds of buffer:

- **sums** (the default): each variable's running sum; the K-th call returns
  ``(sum + g) / K``, as Keras 3 computes it. A cycle restored from a checkpoint saved with
  another K ends at the first call that brings it to K calls or more, with the mean of all of
  them (its count is saved; K is the optimizer's).
- **rows** (``CommunicationOptions(deterministic=True)``): each variable's K gradients
  side by side, ``[K, *shape]``, so that the one exact reduction adds every microbatch of
  every rank exactly and divides by K with one rounding: the same bits whatever the number
  of ranks the microbatches were spread over (K times the gradients' memory).

A checkpoint holds the buffers (each rank's as its row of a ``[R, ...]`` entry, see
:class:`RankShare`) and the count, so a job saved mid-cycle resumes where it was. Bad input
found on a quiet call (another set of variables, a gradient of the wrong shape) cannot be
raised there on one rank alone without stranding the others at the next reduction, so it
is kept and raised on every rank by the K-th call's handshake.

>>> import mpistrat, numpy as np
>>> acc = Accumulator(3, "SGD")
>>> w = mpistrat.Variable(np.zeros(1))
>>> acc.add([np.array([1.0])], [w]), acc.add([np.array([2.0])], [w])
(None, None)
>>> acc.add([np.array([6.0])], [w])
[array([3.])]
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from mpistrat.collectives.sum_modes import EXACT, sum_mode
from mpistrat.comm import packing
from mpistrat.errors import InvalidArgumentError, MpistratError
from mpistrat.interface.saved_entry import PARTS
from mpistrat.options import CommunicationOptions
from mpistrat.training.variables import Variable, Writable, plain_variable
from mpistrat.values import local_variable

__all__ = ["Accumulator", "RankShare", "checked_steps", "exact_rows"]


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


def exact_rows(strategy: Any, options: CommunicationOptions | None) -> bool:
    """Whether accumulation keeps each call's gradient for one exact reduction: the gradients of
    a strategy's optimizer are summed with ``deterministic=True`` (its own ``options`` over the
    strategy's)."""
    if strategy is None:
        return False
    merged = strategy.extended.collectives.options
    if options is not None:
        merged = merged.merge(options)
    return sum_mode(merged) is EXACT


class Accumulator:
    """This rank's gradients of one optimizer over a cycle of ``steps`` calls."""

    def __init__(self, steps: int, name: str):
        self.steps, self._name = steps, name
        # calls of the current cycle so far: a variable, so a checkpoint saves and restores it
        self.counter = plain_variable(np.zeros((), np.int64), f"{name}/accumulation/count")
        self.rows = False  # keep each call's gradient (exact) instead of their sum
        self.buffers: dict[int, tuple[Variable, Any]] = {}  # id(variable): (variable, buffer)
        self.pending: MpistratError | None = None  # bad input of a quiet call, raised at the K-th
        self.restoring = False  # buffers made for a checkpoint to fill, before the next call

    @property
    def count(self) -> int:
        return int(self.counter.local_array)

    def add(self, grads: list[Any], variables: list[Any]) -> list[Any] | None:
        """Keep one call's gradients; None on a quiet call, the K-th call's gradients to reduce:
        means (sums, new arrays) or ``[K, *shape]`` stacks (rows). The K-th call leaves the cycle
        as it was before it until its step ends (:meth:`applying`)."""
        count, self.restoring = self.count, False
        last = count + 1 >= self.steps
        means: list[Any] = []
        try:
            means = self._add(count, grads, variables, last)
        except MpistratError as exc:  # a gradient that is no array: kept, as any bad input
            self._keep(exc)
        if not last:
            self._set_count(count + 1)
            return None
        if self.pending is not None:  # the step's handshake raises it on every rank: nothing is reduced
            return list(grads)
        return [self.buffers[id(v)][1] for v in variables] if self.rows else means

    @contextlib.contextmanager
    def applying(self, strategy: Any) -> Iterator[None]:
        """The K-th call's step. Once it succeeds the cycle ends. If it raises after every rank agreed
        to it (a 16-bit overflow found in the reduction, on every rank), the cycle stays as it was
        before the K-th call, so that a retry of that call applies it once; if its handshake failed
        (bad input on some rank, this call's or a quiet call's), the cycle is dropped on every rank and
        the next call starts a new one. ``strategy``: the optimizer's (None: one process)."""
        collectives = None if strategy is None else strategy.extended.collectives
        disagreements = None if collectives is None else collectives.disagreements
        try:
            yield
        except BaseException:
            self.pending = None
            if collectives is None or collectives.disagreements != disagreements:
                self._set_count(0)
            raise
        self._set_count(0)

    def drop(self) -> None:
        """Forget the cycle in progress (its K-th call raised before its step)."""
        self.pending = None
        self._set_count(0)

    def prepare(self, variables: list[Variable], rows: bool) -> None:
        """Buffers for ``variables`` (zeros), e.g. for a checkpoint to restore into."""
        if rows != self.rows:
            self.buffers.clear()
        self.rows = rows
        for var in variables:
            if id(var) not in self.buffers:
                local = _local(var)
                shape = (self.steps, *local.shape) if rows else local.shape
                self.buffers[id(var)] = (var, packing.array_module(local).zeros(shape, local.dtype))

    def restore_into(self, variables: list[Variable] | None, rows: bool) -> None:
        """Zero buffers for ``variables``, which a checkpoint saved mid-cycle fills (with the count);
        None: forget the cycle in progress (the checkpoint was saved between cycles)."""
        if variables is None:
            self._set_count(0)
            self.pending, self.restoring = None, False
            return
        self.buffers.clear()
        self.prepare(variables, rows)
        self.restoring = True

    def recovery_facts(self) -> None:  # for a recovery after a rank's death (collectives/recoverables.py)
        return None

    def recover(self, recovery: Any, facts: list[Any]) -> None:
        """After a rank's death: the cycle in progress is dropped (the iterators read its batches again)."""
        self.restore_into(None, self.rows)

    def state(self, rank: int, size: int) -> tuple[Variable, list[tuple[Variable, RankShare]]] | None:
        """Mid-cycle (or about to be restored into): the count and each buffer as this rank's row of
        a ``[size, ...]`` checkpoint entry; None between cycles."""
        if self.count == 0 and not self.restoring:
            return None
        return self.counter, [(var, RankShare(var, buf, rank, size)) for var, buf in self.buffers.values()]

    def _set_count(self, count: int) -> None:
        with Writable(self.counter) as value:  # every rank counts alike: no write of a strategy's
            value[...] = count

    def take_pending(self) -> MpistratError | None:
        error, self.pending = self.pending, None
        return error

    def _add(self, count: int, grads: list[Any], variables: list[Any], last: bool) -> list[Any]:
        """Call ``count + 1``'s gradients into the buffers; the last call's means (sums) are new arrays,
        the buffers left holding the earlier calls' sum."""
        if {id(v) for v in variables} != self.buffers.keys() or len(variables) != len(self.buffers):
            if count:
                given = ", ".join(repr(v.name) for v in variables)
                first = ", ".join(repr(v.name) for v, _ in self.buffers.values())
                self._keep(
                    InvalidArgumentError(
                        f"{self._name}.apply_gradients: call {count + 1} of {self.steps} of an accumulation "
                        f"cycle gives gradients for other variables than its first call: {given}, where "
                        f"the first gave {first}; give every call of a cycle the same variables"
                    )
                )
                return []
            self.buffers.clear()
            self.prepare(variables, self.rows)
        means = []
        for grad, var in zip(grads, variables, strict=True):
            buf = self.buffers[id(var)][1]
            if type(grad) is not type(buf):
                grad = packing.as_array(grad, f"{self._name}.apply_gradients: the gradient of {var.name!r}")
            target = buf[count, ...] if self.rows else buf
            if grad.shape != target.shape:
                self._keep(_bad_shape(self._name, grad, var))
            elif grad.dtype != buf.dtype and not np.can_cast(grad.dtype, buf.dtype, "same_kind"):
                self._keep(
                    InvalidArgumentError(
                        f"{self._name}.apply_gradients: the gradient of {var.name!r} is {grad.dtype}; its "
                        f"variable is {buf.dtype}, which it cannot be cast to without losing information"
                    )
                )
            elif self.rows or (count == 0 and not last):
                target[...] = grad
            elif last:  # the buffer keeps the earlier calls' sum until the step succeeded
                mean = packing.array_module(buf).empty_like(buf)
                if count:
                    packing.array_module(buf).add(buf, grad, out=mean)
                else:
                    mean[...] = grad
                mean /= count + 1  # K, or more for a cycle a checkpoint saved with a larger K
                means.append(mean)
            else:
                target += grad
        return means

    def _keep(self, error: MpistratError) -> None:
        if self.pending is None:
            self.pending = error


class RankShare:
    """One rank's accumulation buffer as its row of a ``[size, ...]`` checkpoint entry: written and
    read by that rank alone (a :class:`~mpistrat.interface.saved_entry.PartsEntry`)."""

    holding: Literal["parts"] = PARTS

    def __init__(self, var: Variable, buffer: Any, rank: int, size: int):
        self._var, self._buffer, self._rank = var, buffer, rank
        self.shape = (size, *buffer.shape)
        self.dtype = buffer.dtype
        self.name = f"{var.name}/accumulation"

    @property
    def layout(self) -> tuple[int, str, int, str, int]:
        """Where a checkpoint lays it out, the same on every rank: after the sharded slots of its
        variable's creation order and dtype."""
        return (int(getattr(self._var, "synced_key", 0)), self.dtype.str, 1, "", 0)

    def local_parts(self, writable: bool = False) -> list[tuple[int, Any]]:
        """This rank's row: ``(offset in the flattened entry, a view of the buffer)``."""
        return [(self._rank * int(self._buffer.size), self._buffer.reshape(-1))]


def _local(var: Any) -> Any:
    return local_variable(var).local_array


def _bad_shape(name: str, grad: Any, var: Any) -> InvalidArgumentError:
    shape = tuple(getattr(grad, "shape", ()))
    return InvalidArgumentError(
        f"{name}.apply_gradients: the gradient of {var.name!r} has shape {shape}; "
        f"expected the variable's shape {tuple(var.shape)} (gradients are not broadcast)"
    )
