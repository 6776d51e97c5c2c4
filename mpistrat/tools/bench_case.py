"""What ``mpistrat bench`` builds for one operation at one size, and how its buffers are filled.

An operation (:class:`Op`) builds a :class:`Case` from a :class:`Setup`: callables for
the mpistrat path and for the raw path on the same buffers, each paired with a check of
its result against the value computed from how the buffers were filled. Every rank fills
its buffers with ``(rank + 1) * pattern`` (small integers), so sums are exact in every dtype.

>>> pattern(10, np.dtype("int8"))
array([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], dtype=int8)
>>> split(10, 3)
[4, 3, 3]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import mpistrat

__all__ = [
    "Case",
    "Check",
    "Op",
    "Setup",
    "allgather_factor",
    "allreduce_factor",
    "check_nest",
    "equal",
    "filled",
    "nest",
    "pattern",
    "same",
    "split",
]

Check = Callable[[Any], bool]


@dataclasses.dataclass
class Case:
    """One operation at one size: what to time and how to check each result."""

    nbytes: int  # the size reported (nccl-tests convention: the whole result's bytes)
    count: int  # elements in that result
    leaves: int
    variants: dict[str, tuple[Callable[[], Any], Check]]
    settle: Callable[[], None] | None = None  # after each variant's call, untimed: what it left pending


@dataclasses.dataclass
class Setup:
    """What an operation needs to build a case."""

    strategy: mpistrat.MPIStrategy
    comm: MPI.Intracomm  # the raw path's communicator (not the strategy's)
    dtype: np.dtype
    nbytes: int
    leaves: int
    batch: int
    scaling: str
    shard: bool = False  # the optimizer ops: build the mpistrat optimizer with shard_state=True
    rtol: float = 0.0  # how far a result may be from the exact one (compression); 0: equal
    directory: str | None = None  # the checkpoint ops: where their files go (None: the current directory)
    cleanups: list[Callable[[], None]] = dataclasses.field(default_factory=list)  # run once the case is timed

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()


@dataclasses.dataclass(frozen=True)
class Op:
    """A measured operation: its two sides in words, its context and bus-bandwidth factor."""

    name: str
    mpistrat: str
    raw: str
    raw2: str | None
    context: str  # "replica" (inside one strategy.run), "cross_replica" (in scope) or "none"
    busbw: Callable[[int], float]
    build: Callable[[Setup], Case]
    # Bytes a rank holds while a case is timed, in multiples of its size: a constant, and as much
    # again per rank (merge_call's root gathers every rank's). Measured at 16 MiB, 1 and 2 ranks
    # (benchmarks/bench_footprint.py), rounded up; bench refuses sizes whose footprint does not fit.
    footprint: tuple[int, int] = (8, 0)

    def bytes_needed(self, nbytes: int, ranks: int) -> int:
        constant, per_rank = self.footprint
        return (constant + per_rank * ranks) * nbytes


def pattern(count: int, dtype: np.dtype) -> np.ndarray:
    """``count`` elements cycling through 1 to 8."""
    return (np.arange(count) % 8 + 1).astype(dtype)


def filled(count: int, s: Setup) -> tuple[np.ndarray, np.ndarray]:
    """This rank's buffer and the sum of every rank's buffer."""
    base = pattern(count, s.dtype)
    mine = base * s.dtype.type(s.rank + 1)
    total = base * s.dtype.type(s.size * (s.size + 1) // 2)
    return mine, total


def same(got: Any, want: np.ndarray, rtol: float) -> bool:
    """Equal, or within ``rtol`` of ``want`` when it is not 0."""
    if rtol == 0:
        return bool(np.array_equal(got, want))
    return bool(np.allclose(got, want, rtol=rtol, atol=0.0))


def equal(want: np.ndarray, rtol: float = 0.0) -> Check:
    """A check that a result is :func:`same` as ``want``."""
    return lambda got: same(got, want, rtol)


def split(count: int, parts: int) -> list[int]:
    """``count`` elements in ``parts`` near-equal positive pieces."""
    base, extra = divmod(count, parts)
    return [base + (i < extra) for i in range(parts)]


def allreduce_factor(n: int) -> float:
    """nccl-tests' bus-bandwidth factor of an all-reduce over ``n`` ranks."""
    return 2.0 * (n - 1) / n


def allgather_factor(n: int) -> float:
    """nccl-tests' bus-bandwidth factor of an all-gather over ``n`` ranks."""
    return (n - 1) / n


def nest(count: int, s: Setup) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """:func:`filled`'s two arrays cut into ``s.leaves`` named leaves."""
    x, want = filled(count, s)
    names = [f"layer{k:03d}" for k in range(s.leaves)]
    bounds = np.cumsum([0, *split(count, s.leaves)])
    tree = {n: x[a:b].copy() for n, a, b in zip(names, bounds[:-1], bounds[1:], strict=True)}
    wants = {n: want[a:b] for n, a, b in zip(names, bounds[:-1], bounds[1:], strict=True)}
    return tree, wants


def check_nest(wants: dict[str, np.ndarray], rtol: float = 0.0) -> Check:
    """A check that a nest result has ``wants``'s keys and values."""

    def check(got: Any) -> bool:
        return len(got) == len(wants) and all(same(got[k], w, rtol) for k, w in wants.items())

    return check
