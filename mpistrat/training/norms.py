"""Squared norms over whole variables, from the elements each rank holds of one step's packs.

Clipping by norm and LAMB's trust ratios need ``sum(x**2)`` over every element of a variable
(or of every variable). Unsharded, every rank holds every element, and its own sums are the
answer. Sharded, each rank holds a part: it sums the squares of its elements per variable and
one all-reduce of that vector (a float64 per variable, or one for a total) adds the parts, so
the bytes do not grow with the ranks, and no gradient is gathered. A flag (a loss-scaled step's
"not finite here") rides in the same all-reduce.

With ``deterministic=True`` the answer must not depend on how the elements are split over the
ranks (nor on whether they are), and float partial sums do. Each square is then put on a
fixed-point grid that depends only on the largest square of the variable on any rank and the
variable's size (sharded, one all-reduce of the largest exponents, ``MAX``): floored to that
grid, the squares are integers, whose sum is the same at any rank count (one all-reduce of
int64, exact), accurate to about 2**-50 of the largest square.

>>> grid_shift(exponent=3, count=1000)  # squares < 2**3, a thousand of them: 2**(61 - 3 - 10)
48
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat.comm import packing
from mpistrat.options import CommunicationOptions
from mpistrat.training.pack_step import Pack
from mpistrat.training.variables import to_numpy

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["CHUNK", "Norms", "grid_shift"]

_PLAIN = CommunicationOptions(deterministic=False, compression="none")
CHUNK = 1 << 16  # elements per dot of a total's sum
_NO_EXPONENT = -1100  # below any float64's: a variable whose squares are all zero


def grid_shift(exponent: int, count: int) -> int:
    """The power of two that scales ``count`` squares below ``2**exponent`` to integers summing
    below ``2**61``."""
    return 61 - exponent - max(0, math.ceil(math.log2(max(count, 1))))


class Norms:
    """The variables of one step's ``packs``, numbered, and their squared norms over the ranks.

    Args:
        packs: the step's reduced packs (every rank has the same group steps, in the same order).
        collectives: the strategy's; sums travel only when ``sharded``.
        exact: ``deterministic=True``: the same sums at any rank count (see the module).
    """

    def __init__(
        self, packs: list[Pack], collectives: Collectives | None, sharded: bool, exact: bool, kind: str
    ):
        self.packs, self.collectives, self.kind = packs, collectives, kind
        self.sharded = sharded and collectives is not None
        self.exact = exact
        self._start: dict[int, int] = {}  # by group: a step holds each group once
        self._groups: list[Any] = []  # a step of each group, in number order
        self.count = 0  # variables
        for s, *_ in packs:
            if id(s.group) not in self._start:
                self._start[id(s.group)] = self.count
                self._groups.append(s)
                self.count += len(s.present)

    @functools.cached_property
    def sizes(self) -> np.ndarray:
        """Each variable's number of elements, by number."""
        spans = [s.group.params.spans[i] for s in self._groups for i in s.present]
        return np.array([b - a for a, b in spans], np.int64)

    def index(self, s: Any, p: int) -> int:
        """The number of variable ``p`` of group step ``s`` (or of another view of its group's step)."""
        return self._start[id(s.group)] + p

    def squares(
        self, sources: list[str], per_variable: bool, flag: float | None = None
    ) -> tuple[np.ndarray, float]:
        """``[len(sources), variables or 1]`` sums of squares over the ranks of the gradient
        (``"grad"``) or the weights (``"weights"``), and ``flag`` summed over the ranks."""
        if self.exact:
            return self._exact(sources, per_variable, flag)
        return self.summed(self._local(sources, per_variable), flag)

    def summed(self, partial: list[list[float]], flag: float | None = None) -> tuple[np.ndarray, float]:
        """This rank's ``partial`` sums (a row per source) and ``flag``, summed over the ranks when
        sharded: one all-reduce of a float64 each."""
        local = np.array(partial, np.float64)
        vector = local.ravel() if flag is None else np.append(local.ravel(), flag)
        if self.sharded:
            assert self.collectives is not None
            self.collectives.all_reduce_in_place(vector, kind=self.kind, options=_PLAIN)
        return vector[: local.size].reshape(local.shape), 0.0 if flag is None else float(vector[-1])

    def _local(self, sources: list[str], per_variable: bool) -> list[list[float]]:
        """This rank's sums of squares of each source, per variable or in one total: a BLAS dot per
        variable, or per ``CHUNK`` of each range this rank updates (float32 dots over a few
        thousand elements keep their digits; their sum is float64)."""
        rows = [[0.0] * (self.count if per_variable else 1) for _ in sources]
        for s, k, grad, base, params, _ in self.packs:
            if per_variable:
                first = self._start[id(s.group)]
                ranges = [(a, b, first + p) for a, b, p in s.segments[k]]
            else:
                ranges = [(c, min(c + CHUNK, b), 0) for a, b in s.updates[k] for c in range(a, b, CHUNK)]
            dot = packing.array_module(grad).vdot
            for sums, source in zip(rows, sources, strict=True):
                x, shift = (grad, base) if source == "grad" else (params, 0)
                for a, b, n in ranges:
                    v = x[a - shift : b - shift]
                    sums[n] += float(dot(v, v).real)
        return rows

    def _pieces(self, sources: list[str]) -> Any:
        """(row, this rank's elements of one variable in one pack, the variable's number)."""
        for s, k, grad, base, params, _ in self.packs:
            for a, b, p in s.segments[k]:
                for row, source in enumerate(sources):
                    yield (
                        row,
                        (grad[a - base : b - base] if source == "grad" else params[a:b]),
                        self.index(s, p),
                    )

    def _exact(self, sources: list[str], per_variable: bool, flag: float | None) -> tuple[np.ndarray, float]:
        """Fixed-point sums on a grid every rank derives alike (see the module's docstring)."""
        columns = self.count if per_variable else 1
        exponents = np.full((len(sources), columns), _NO_EXPONENT, np.int64)
        nonfinite = 0
        squares = []
        for row, x, n in self._pieces(sources):
            sq = np.square(np.abs(to_numpy(x)).astype(np.float64))
            column = n if per_variable else 0
            if sq.size:
                top = float(sq.max())
                if not math.isfinite(top):
                    nonfinite = 1
                elif top > 0:
                    exponents[row, column] = max(exponents[row, column], math.frexp(top)[1])
            squares.append((row, column, sq))
        agreed = np.append(exponents.ravel(), nonfinite)
        if self.sharded:
            assert self.collectives is not None
            self.collectives.all_reduce_in_place(agreed, kind=self.kind, maximum=True)
        top_exponents = agreed[:-1].reshape(exponents.shape)
        counts = self.sizes if per_variable else np.array([self.sizes.sum()])
        shifts = np.array(
            [[grid_shift(int(e), int(c)) for e, c in zip(r, counts, strict=True)] for r in top_exponents]
        )
        integers = np.zeros(top_exponents.shape, np.int64)
        if not agreed[-1]:
            for row, column, sq in squares:
                integers[row, column] += int(
                    np.floor(np.ldexp(sq, int(shifts[row, column]))).astype(np.int64).sum()
                )
        summed = np.append(integers.ravel(), np.int64(0 if flag is None else flag))
        if self.sharded:
            assert self.collectives is not None
            self.collectives.all_reduce_in_place(summed, kind=self.kind, options=_PLAIN)
        totals = np.ldexp(summed[:-1].reshape(integers.shape).astype(np.float64), -shifts)
        if agreed[-1]:  # an inf or NaN on some rank: the norm is not finite, as a float sum would say
            totals[...] = math.nan
        return totals, float(summed[-1])
