"""LAMB's trust ratios over one step's packs: ``w -= lr * ||w|| / ||u|| * u`` per variable.

The norms are over whole variables, of the weights and of the update's direction ``u`` (left in
the gradient's buffer). :meth:`TrustRatios.block` sums this rank's squares of each variable's
elements in a block right after the update's pass wrote it (``pack_step.update_pack``), while the
block is in cache, instead of in a pass of its own over every pack. Unsharded, every rank holds
every element: a variable held whole in one pack has its ratio once its last block is summed, and
is stepped there, still in cache. :meth:`TrustRatios.finish` then sums the partial sums over the
ranks (sharded: one all-reduce of two float64 per variable, never a gather) and steps the rest.

With exact sums (``deterministic=True``), and on device arrays (whose dots would each wait for
the device), :class:`~mpistrat.training.norms.Norms` sums whole variables after the update
instead (its exact grid needs each variable's largest square first).

>>> factor(9.0, 4.0, 0.5)  # lr * ||w|| / ||u|| = 0.5 * 3 / 2
0.75
>>> factor(9.0, 0.0, 0.5)  # a norm of zero: the ratio is 1
0.5
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from mpistrat.comm import packing
from mpistrat.training.norms import Norms
from mpistrat.training.pack_step import Pack, Read

__all__ = ["TrustRatios", "factor"]


def factor(weights: float, direction: float, lr: float) -> float:
    """``lr`` times the ratio of the norms whose squares are given (1 when either is 0, as Keras)."""
    w, u = math.sqrt(weights), math.sqrt(direction)
    return lr * (w / u if w > 0 and u > 0 else 1.0)


class TrustRatios:
    """One step's trust ratios (see the module).

    Args:
        norms: the step's variables, numbered, and how their sums travel.
        lr: the step's learning rate.
    """

    def __init__(self, norms: Norms, lr: float):
        self.norms, self.lr = norms, lr
        host = all(packing.array_module(grad) is np for _, _, grad, _, _, _ in norms.packs)
        self.blockwise = host and not norms.exact  # summed in the update's pass
        self.partial = [[0.0] * norms.count, [0.0] * norms.count]  # this rank's squares of w and u
        # a variable is stepped in the update's pass when this rank's sums are the whole norms
        self.early = self.blockwise and not norms.sharded
        self._sizes = norms.sizes.tolist()
        self.factors: list[float] | None = None  # by variable number, once known over the ranks
        self.stepped = [False] * norms.count  # in the update's pass

    def each_block(self, pack: Pack) -> Read | None:
        """What ``pack_step.update_pack`` calls with each block of ``pack`` it updated, or None."""
        if not self.blockwise:
            return None
        stops = [b for _, b, _ in pack.step.segments[pack.k]]
        return lambda start, stop: self.block(pack, stops, start, stop)

    def block(self, pack: Pack, stops: list[int], start: int, stop: int) -> None:
        """Parameters ``start:stop`` of ``pack`` (ascending from one call to the next), just updated:
        their squares added to their variables' sums; a variable held whole that ends here stepped."""
        s, k, grad, base, params, _ = pack
        segments, first = s.segments[k], self.norms.index(s, 0)
        (weights, direction), early, sizes = self.partial, self.early, self._sizes
        i = bisect.bisect_right(stops, start)  # the first variable that ends after start
        while i < len(segments) and segments[i][0] < stop:  # a Python loop per variable: kept lean
            a, b, p = segments[i]
            n, i = first + p, i + 1
            lo, hi = (a, b) if start <= a and b <= stop else (max(a, start), min(b, stop))
            w, u = params[lo:hi], grad[lo - base : hi - base]
            weights[n] += float(w.dot(w))  # 1-D: a BLAS dot, as np.vdot, with less around it
            direction[n] += float(u.dot(u))
            if early and b <= stop and b - a == sizes[n]:  # its last block: w and u in cache
                if lo != a:
                    w, u = params[a:b], grad[a - base : b - base]
                u *= factor(weights[n], direction[n], self.lr)
                w -= u
                self.stepped[n] = True

    def finish(self, packs: list[Pack]) -> None:
        """The ratios over the ranks, and every variable not stepped yet stepped."""
        if self.blockwise:
            squares = self.norms.summed(self.partial)[0]
        else:
            squares = self.norms.squares(["weights", "grad"], per_variable=True)[0]
        weights, direction = squares.tolist()
        self.factors = [factor(w, u, self.lr) for w, u in zip(weights, direction, strict=True)]
        self.step(packs, skip=self.stepped)

    def step(self, packs: list[Pack], skip: list[bool] | None = None) -> None:
        """``w -= factor * u`` on each variable's elements in ``packs`` (but those ``skip`` marks),
        with the factors :meth:`finish` found."""
        factors, numbers = self.factors, self.norms
        assert factors is not None
        for s, k, grad, base, params, _ in packs:
            first = numbers.index(s, 0)
            for a, b, p in s.segments[k]:
                if skip is None or not skip[first + p]:
                    w, u = params[a:b], grad[a - base : b - base]
                    u *= factors[first + p]  # a float: a multiply in the variables' dtype, not float64
                    w -= u
