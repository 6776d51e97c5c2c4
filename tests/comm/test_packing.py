"""Packing leaves into per-dtype buffers and back, and the all_reduce results built on it.

The reference is a plain NumPy computation: ``np.ravel`` in C order for what a pack
holds, and a serial sum over every rank's (reproducible) nest for all_reduce.
"""

import numpy as np
import optree
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpistrat
from mpistrat.comm import packing
from tests.conftest import RankChecks, all_ranks_agree

DTYPES = ["float32", "float64", "int32", "int64", "uint8", "complex64", ">f8"]


def leaf(draw, dtype):
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple))
    arr = (np.arange(int(np.prod(shape, dtype=np.int64))) % 7 + 1).astype(dtype).reshape(shape)
    layout = draw(st.sampled_from(["c", "f", "strided"]))
    if layout == "f":
        arr = np.asfortranarray(arr)
    elif layout == "strided" and arr.ndim:
        arr = np.repeat(arr, 2, axis=-1)[..., ::2]
    return arr


@st.composite
def leaves(draw):
    dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=1, max_size=6))
    return [leaf(draw, d) for d in dtypes]


@settings(max_examples=150, deadline=None)
@given(arrays=leaves(), bytes_per_pack=st.sampled_from([0, 1, 16, 64]))
def test_pack_then_unpack_round_trips_every_leaf(arrays, bytes_per_pack):
    for attempt in range(2):  # the second plan comes from the cache
        packs = packing.plan_packs(arrays, bytes_per_pack)
        seen = sorted(i for p in packs for i in p.indices)
        assert seen == list(range(len(arrays))), attempt
        out = [None] * len(arrays)
        for p in packs:
            assert all(arrays[i].dtype == p.dtype for i in p.indices)
            buf = packing.pack(arrays, p)
            want = np.concatenate([np.ravel(arrays[i], order="C") for i in p.indices]).astype(p.dtype)
            assert buf.dtype == p.dtype and buf.ndim == 1 and np.array_equal(buf, want)
            assert not any(np.shares_memory(buf, arrays[i]) for i in p.indices)
            packing.unpack(buf, arrays, p, out)
        for got, arr in zip(out, arrays, strict=True):
            assert got.shape == arr.shape and got.dtype == arr.dtype and np.array_equal(got, arr)


def test_plans_follow_first_seen_dtype_order_and_split_by_bytes():
    arrays = [np.ones(2, "f4"), np.ones(3, "i8"), np.ones(1, "f4"), np.ones(4, "f4")]
    assert [(p.dtype.name, p.indices) for p in packing.plan_packs(arrays)] == [
        ("float32", [0, 2, 3]),
        ("int64", [1]),
    ]
    split = packing.plan_packs(arrays, bytes_per_pack=12)
    assert [(p.dtype.name, p.indices) for p in split] == [
        ("float32", [0, 2]),
        ("float32", [3]),
        ("int64", [1]),
    ]


def test_as_arrays_accepts_numbers_and_refuses_other_types():
    got = packing.as_arrays([np.ones(2), 3, 2.5, np.float32(1)])
    assert [type(a) for a in got] == [np.ndarray] * 4 and got[1].dtype == np.asarray(3).dtype
    with pytest.raises(mpistrat.UnsupportedTypeError, match="numeric dtype"):
        packing.as_arrays([np.ones(2), np.array(["a"])])
    with pytest.raises(mpistrat.UnsupportedTypeError, match="expected a NumPy"):
        packing.as_arrays([np.ones(2), "text"])


def test_all_numpy_is_exact_about_the_type():
    assert packing.all_numpy([np.ones(2), np.zeros((2, 2))])
    assert not packing.all_numpy([np.ones(2), np.ma.masked_array([1.0])])
    assert not packing.all_numpy([np.ones(2), 1])


def _nest(rank):
    """A reproducible nest for ``rank``: mixed dtypes, 0-d, 2-D, strided and Fortran leaves."""
    base = np.arange(12, dtype=np.float64).reshape(3, 4) + rank
    return {
        "dense": {"kernel": base.astype(np.float32), "bias": np.full(4, rank + 1, np.float32)},
        "count": np.array(rank + 2, dtype=np.int64),
        "ints": (np.arange(6, dtype=np.int32) * (rank + 1)).reshape(2, 3),
        "strided": base[:, ::2],
        "fortran": np.asfortranarray(base.T),
        "scalar": float(rank),
        "empty": np.zeros((0, 3), np.float32),
    }


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("bytes_per_pack", [0, 24])
def test_all_reduce_of_a_mixed_nest_matches_a_serial_sum(group, op, bytes_per_pack):
    checks = RankChecks()
    n = group.size
    options = mpistrat.CommunicationOptions(bytes_per_pack=bytes_per_pack)
    for _ in range(2):  # the second call runs on cached plans and fingerprints
        got = group.strategy.run(
            lambda: mpistrat.get_replica_context().all_reduce(op, _nest(group.rank), options)
        )
        parts = [_nest(r) for r in range(n)]
        want = mpistrat.nest.map_structure(lambda *xs: sum(np.asarray(x) for x in xs), *parts)
        if op == "mean":
            want = mpistrat.nest.map_structure(lambda x: np.true_divide(x, n), want)
        flat_got, flat_want = mpistrat.nest.flatten(got), mpistrat.nest.flatten(want)
        checks.that(
            mpistrat.nest.flatten_with_paths(got)[0][0] == mpistrat.nest.flatten_with_paths(want)[0][0]
            and all(
                np.shape(g) == np.shape(w)
                and np.asarray(g).dtype == np.asarray(w).dtype
                and np.array_equal(g, w)
                for g, w in zip(flat_got, flat_want, strict=True)
            )
        )
        checks.that(isinstance(got["scalar"], np.floating))
        checks.agree(group.comm, f"{got} != {want}")


def test_all_reduce_results_do_not_alias_the_inputs(group):
    x = {"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)}
    got = group.strategy.run(lambda: mpistrat.get_replica_context().all_reduce("mean", x))
    got["a"][:] = -1
    ok = np.array_equal(x["a"], np.ones(3)) and np.array_equal(got["b"], np.ones(2))
    all_ranks_agree(group.comm, ok, f"{x} {got}")


@st.composite
def containers(draw):
    kind = draw(st.sampled_from(["list", "tuple", "dict", "nested", "array"]))
    n = draw(st.integers(0, 5))
    values = [np.full(draw(st.integers(0, 3)), i, dtype=draw(st.sampled_from(DTYPES))) for i in range(n)]
    if draw(st.booleans()) and values:  # sometimes not all arrays: a number, None
        values[draw(st.integers(0, n - 1))] = draw(st.sampled_from([1.5, None, 7]))
    if kind == "list":
        return values
    if kind == "tuple":
        return tuple(values)
    if kind == "array":
        return values[0] if values and isinstance(values[0], np.ndarray) else np.zeros(2)
    keys = draw(st.permutations(["w", "b", "a", "kernel", "z"]))[:n]
    d = dict(zip(keys, values, strict=True))
    return {"outer": d, "x": np.ones(1)} if kind == "nested" else d


@settings(max_examples=200, deadline=None)
@given(value=containers())
def test_fast_flatten_is_optree_flatten(value):
    from mpistrat.collectives.leaves import LEAF_SPEC, unflatten
    from mpistrat.collectives.leaves import flatten as _flatten

    want_leaves, want_spec = optree.tree_flatten(value, none_is_leaf=True, namespace="mpistrat")
    for _ in range(2):  # the second call may come from the remembered structure
        leaves, spec = _flatten(value)
        # one leaf (of any type) has one structure of its own, made without optree
        assert spec is LEAF_SPEC if want_spec.is_leaf() else spec == want_spec
        assert len(leaves) == len(want_leaves) and all(
            a is b for a, b in zip(leaves, want_leaves, strict=True)
        )
        rebuilt = unflatten(spec, leaves)
        assert optree.tree_structure(rebuilt, none_is_leaf=True, namespace="mpistrat") == want_spec
        assert all(
            a is b for a, b in zip(optree.tree_leaves(rebuilt, none_is_leaf=True), leaves, strict=True)
        )


def test_large_buffers_are_recycled_only_when_nothing_refers_to_them():
    shape, pool = (packing.POOL_MIN_BYTES // 4 + 7,), []
    a = packing.empty(shape, np.float32, np, pool)
    first = id(a)
    del a
    b = packing.empty(shape, np.float32, np, pool)
    assert id(b) == first  # dropped by its holder: reused
    held = [packing.empty(shape, np.float32, np, pool) for _ in range(2)]
    assert all(h is not b for h in held) and held[0] is not held[1]
    view, exported = b[1:3], memoryview(held[0])
    del b
    fresh = packing.empty(shape, np.float32, np, pool)
    assert id(fresh) not in (first, id(held[0]), id(held[1]))  # a view or an export keeps it busy
    del view, exported


def test_a_recycled_buffer_is_writable_whatever_its_last_holder_marked():
    shape, pool = (packing.POOL_MIN_BYTES // 8 + 3,), []
    a = packing.empty(shape, np.float64, np, pool)
    a.flags.writeable = False  # as a variable's value() marks its own array
    first = id(a)
    del a
    b = packing.empty(shape, np.float64, np, pool)
    assert id(b) == first and b.flags.writeable  # MPI receives into it
    b[:] = 1.0


def test_all_reduce_results_stay_valid_when_the_next_call_reuses_memory(group):
    big = np.arange(packing.POOL_MIN_BYTES // 4, dtype=np.float32)

    def step():
        ctx = mpistrat.get_replica_context()
        kept = ctx.all_reduce("sum", big)
        kept_view = ctx.all_reduce("sum", big * 2)[:10]
        for _ in range(3):
            ctx.all_reduce("sum", big * 3)  # dropped at once: its buffer is recycled
        return kept, kept_view

    kept, kept_view = group.strategy.run(step)
    n = group.size
    ok = np.array_equal(kept, big * n) and np.array_equal(kept_view, big[:10] * 2 * n)
    all_ranks_agree(group.comm, ok, f"{kept[:4]} {kept_view[:4]}")


def test_fast_flatten_never_mistakes_a_nested_container_for_a_flat_one():
    from mpistrat.collectives.leaves import flatten as _flatten

    x = np.ones(2)
    sequence = [{"a": (x,), "b": x}, {"a": x, "b": x}, {"a": (x,), "b": x}, [x, [x]], [x, x], [x, [x]], (x,)]
    for value in sequence:  # the same keys/lengths in turn nested and flat, so a wrong cache would show
        leaves, spec = _flatten(value)
        want_leaves, want_spec = optree.tree_flatten(value, none_is_leaf=True, namespace="mpistrat")
        assert spec == want_spec and all(a is b for a, b in zip(leaves, want_leaves, strict=True))


def test_each_strategy_owns_its_caches_and_a_loop_reuses_them(group):
    """Flattening, pack plans and fingerprints are remembered per strategy (not per process),
    bounded, and a training loop's repeated calls find them."""
    grads = {"w": np.ones((3, 2), np.float32), "b": np.zeros(2, np.float32)}
    other = mpistrat.MPIStrategy(group.comm)
    caches = other.extended.collectives.caches
    assert caches is not group.strategy.extended.collectives.caches
    assert not caches.plans and not caches.flat

    def step():
        return mpistrat.get_replica_context().all_reduce("sum", grads)

    for _ in range(5):
        got = other.run(step)
    sizes = (len(caches.flat), len(caches.plans), len(caches.packs))
    checks = RankChecks()
    checks.that(sizes == (1, 1, 1) and np.array_equal(got["w"], grads["w"] * group.size))
    caches.clear()
    again = other.run(step)
    checks.that(np.array_equal(again["b"], grads["b"]) and len(caches.plans) == 1)
    checks.agree(group.comm, f"{sizes}")
    other.experimental_finalize()
