"""Property tests: random nests of random dtypes, shapes and memory layouts.

Hypothesis draws the *structure* identically on every rank (derandomized, no
shrinking): a nest whose leaves are specs like ``"f4|2,3|F"``, plus a seed. Each
rank makes its data from ``(seed, rank)``, so every rank can rebuild every other
rank's data and compute the serial NumPy reference. Checks are collective, so a
failure on one rank fails every rank.
"""

from __future__ import annotations

import collections
import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import mpistrat
from mpistrat import nest
from tests.conftest import all_ranks_agree

Pair = collections.namedtuple("Pair", "left right")

SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=30,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
)
DTYPES = ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]
TOLERANCE = {"e": 2e-2, "f": 1e-5, "F": 1e-5, "d": 1e-12, "D": 1e-12}


def leaf_specs(min_ndim: int) -> st.SearchStrategy[str]:
    shape = st.lists(st.integers(0, 3), min_size=min_ndim, max_size=3)
    return st.builds(
        lambda d, s, layout: f"{d}|{','.join(map(str, s))}|{layout}",
        st.sampled_from(DTYPES),
        shape,
        st.sampled_from(["C", "F", "strided"]),
    )


def nests(leaf: st.SearchStrategy[str]) -> st.SearchStrategy:
    """Dicts, lists, tuples and namedtuples of leaf specs, up to depth 3."""
    level = leaf
    for _ in range(3):
        children = st.one_of(leaf, level)
        level = st.one_of(
            st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3).map(tuple),
            st.builds(Pair, children, children),
        )
    return st.one_of(leaf, level)


def make_array(
    spec: str, rng: np.random.Generator, axis_size: int | None = None, axis: int = 0
) -> np.ndarray:
    dtype_name, shape_text, layout = spec.split("|")
    dtype = np.dtype(dtype_name)
    shape = [int(n) for n in shape_text.split(",") if n]
    if axis_size is not None:
        shape[axis] = axis_size
    if dtype.kind in "iu":
        # 8-bit values stay in range when summed over the suite's 4 ranks at most: how an 8- or 16-bit
        # sum overflows is the MPI library's (test_small_integer_sums_that_overflow_are_the_mpi_librarys).
        high = 32 if dtype.itemsize == 1 else 50
        data = rng.integers(0 if dtype.kind == "u" else -high, high, size=shape).astype(dtype)
    elif dtype.kind == "f":
        data = rng.standard_normal(shape).astype(dtype)
    else:
        data = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    if layout == "F":
        return np.asfortranarray(data)
    if layout == "strided" and data.ndim:
        wide = np.zeros((*data.shape[:-1], 2 * data.shape[-1]), dtype=dtype)
        wide[..., ::2] = data
        return wide[..., ::2]  # a non-contiguous view with the same values
    return data


def build(structure, seed: int, rank: int, axis: int | None = None):
    """This rank's data; with ``axis``, the size along it is drawn per rank (uneven gathers)."""
    rng = np.random.default_rng([seed, rank])
    if axis is None:
        return nest.map_structure(lambda s: make_array(s, rng), structure)
    return nest.map_structure(lambda s: make_array(s, rng, int(rng.integers(0, 4)), axis), structure)


def close(got, want) -> bool:
    got = np.asarray(got)
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    tol = TOLERANCE.get(want.dtype.char)
    if tol is None:
        return np.array_equal(got, want)
    return np.allclose(got, want, rtol=tol, atol=tol)


def all_close(got, want) -> bool:
    nest.assert_same_structure(got, want)
    return all(close(g, w) for g, w in zip(nest.flatten(got), nest.flatten(want), strict=True))


@SETTINGS
@given(structure=nests(leaf_specs(0)), seed=st.integers(0, 2**31 - 1), op=st.sampled_from(["SUM", "MEAN"]))
def test_all_reduce_matches_serial_numpy(group, structure, seed, op):
    def step():
        return mpistrat.get_replica_context().all_reduce(op, build(structure, seed, group.rank))

    got = group.strategy.run(step)

    def reference(*values):
        total = functools.reduce(np.add, values)
        return np.true_divide(total, len(values)) if op == "MEAN" else total

    want = nest.map_structure(reference, *[build(structure, seed, r) for r in range(group.size)])
    all_ranks_agree(group.comm, all_close(got, want), f"structure={structure} seed={seed} op={op}")


@pytest.mark.parametrize("length", [1, 64])  # Open MPI saturates where it sums with vector instructions
@pytest.mark.parametrize("dtype", ["i1", "u1", "i2", "u2"])
def test_small_integer_sums_that_overflow_are_the_mpi_librarys(world, dtype, length):
    """An 8- or 16-bit sum that overflows: MPICH and Intel MPI wrap as NumPy does, Open MPI's
    vectorized sums saturate (ompi#8045; docs/reliability.md). all_reduce passes either through."""
    x = np.full(length, np.iinfo(dtype).max // 2 + 1, dtype=dtype)  # two ranks' sum overflows
    got = world.strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", x))
    raw = np.empty_like(x)
    world.comm.Allreduce(x, raw)
    wrapped = functools.reduce(np.add, [x] * world.size)
    saturated = np.minimum(x.astype(np.int64) * world.size, np.iinfo(dtype).max).astype(dtype)
    known = np.array_equal(raw, wrapped) or np.array_equal(raw, saturated)
    all_ranks_agree(world.comm, got.dtype == x.dtype and np.array_equal(got, raw) and known, f"{got} {raw}")


@SETTINGS
@given(structure=nests(leaf_specs(1)), seed=st.integers(0, 2**31 - 1), axis=st.sampled_from([0, -1]))
def test_uneven_all_gather_matches_serial_numpy(group, structure, seed, axis):
    def step():
        return mpistrat.get_replica_context().all_gather(build(structure, seed, group.rank, axis), axis=axis)

    got = group.strategy.run(step)
    parts = [build(structure, seed, r, axis) for r in range(group.size)]
    want = nest.map_structure(lambda *xs: np.concatenate(xs, axis=axis), *parts)
    all_ranks_agree(group.comm, all_close(got, want), f"structure={structure} seed={seed} axis={axis}")


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # MEAN over zero elements is NaN
@SETTINGS
@given(
    structure=nests(leaf_specs(1)),
    seed=st.integers(0, 2**31 - 1),
    op=st.sampled_from(["SUM", "MEAN"]),
    axis=st.sampled_from([None, 0]),
)
def test_strategy_reduce_matches_serial_numpy(group, structure, seed, op, axis):
    structure = nest.map_structure(
        lambda s: s if s.split("|")[0][0] in "fc" else "f8" + s[s.index("|") :], structure
    )
    with group.strategy.scope():
        got = group.strategy.reduce(op, build(structure, seed, group.rank, axis), axis=axis)
    parts = [build(structure, seed, r, axis) for r in range(group.size)]

    def reference(*values):
        if axis is None:
            total = functools.reduce(np.add, values)
            return total / len(values) if op == "MEAN" else total
        total = functools.reduce(np.add, [v.sum(axis=0, dtype=v.dtype) for v in values])
        return total / sum(v.shape[0] for v in values) if op == "MEAN" else total

    want = nest.map_structure(reference, *parts)
    ok = all(
        np.allclose(
            np.asarray(g),
            w,
            rtol=TOLERANCE[w.dtype.char] * 10,
            atol=TOLERANCE[w.dtype.char] * 10,
            equal_nan=True,
        )
        and np.asarray(g).shape == w.shape
        for g, w in zip(nest.flatten(got), nest.flatten(want), strict=True)
    )
    all_ranks_agree(group.comm, ok, f"structure={structure} seed={seed} op={op} axis={axis}")
