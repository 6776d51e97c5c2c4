"""Unbatched elements (per-replica pipelines, and global datasets), and ``next(iterator)`` inside ``run``.

Expected values are TensorFlow 2.21's (``tensorflow-cpu``): ``MultiWorkerMirroredStrategy`` on one
worker, whose one replica is what each rank is here, reading ``distribute_datasets_from_function``
pipelines of ``tf.data`` elements before ``batch()``; the dummy element an exhausted worker gets is
``input_lib._dummy_tensor_fn`` of the element spec. Replica ``r`` is rank ``r``.
"""

import numpy as np
import pytest

import mpistrat
from mpistrat import ArraySpec, CollectiveMismatchError, InputOptions, InvalidArgumentError
from tests.conftest import RankChecks, all_ranks_agree, raises_on_every_rank

NEXT_IN_RUN = (
    "next(iterator) should be called from outside of replica_fn. "
    "e.g. strategy.run(replica_fn, args=(next(iterator),))"
)


def test_a_pipeline_of_scalars_gives_one_scalar_per_replica_per_step(group):
    # tf: distribute_datasets_from_function(lambda ctx: Dataset.range(4)): element_spec
    # TensorSpec(shape=(), dtype=tf.int64); the replica's values, step by step: 0, 1, 2, 3
    s = group.strategy
    with s.scope():
        dist = s.distribute_datasets_from_function(lambda ctx: range(4))
    spec = dist.element_spec
    got = [s.experimental_local_results(x) for x in dist]
    values = [[int(v) for v in x] for x in got]
    shapes = {np.shape(v) for x in got for v in x}
    all_ranks_agree(
        group.comm,
        spec == ArraySpec((), np.dtype(np.int64)) and values == [[0], [1], [2], [3]] and shapes == {()},
        f"{spec} {got}",
    )


def test_a_pipeline_of_unbatched_dicts(group):
    # tf: Dataset.from_tensor_slices({"a": range(4) int32, "b": [1., 2., 3., 4.] float32}):
    # element_spec {'a': TensorSpec((), int32), 'b': TensorSpec((), float32)};
    # next(it) == {'a': 0, 'b': 1.0}; it.get_next_as_optional().get_value() == {'a': 1, 'b': 2.0}
    s = group.strategy

    def dataset_fn(ctx):
        a, b = np.arange(4, dtype=np.int32), np.array([1.0, 2.0, 3.0, 4.0], np.float32)
        return ({"a": a[i], "b": b[i]} for i in range(4))

    dist = s.distribute_datasets_from_function(dataset_fn)
    it = iter(dist)
    first = next(it)
    second = it.get_next_as_optional().get_value()
    want_spec = {"a": ArraySpec((), np.dtype(np.int32)), "b": ArraySpec((), np.dtype(np.float32))}
    ok = (
        dist.element_spec == want_spec
        and it.element_spec == want_spec
        and (int(first["a"]), float(first["b"])) == (0, 1.0)
        and (int(second["a"]), float(second["b"])) == (1, 2.0)
        and first["b"].dtype == np.float32
        and first["a"].dtype == np.int32
    )
    all_ranks_agree(group.comm, ok, f"{dist.element_spec} {first} {second}")


def test_an_element_with_a_scalar_leaf_is_unbatched_whatever_its_other_leaves(group):
    # tf: from_tensor_slices({"x": zeros((2, 3)), "y": [1, 2]}): element_spec
    # {'x': TensorSpec((3,), float32), 'y': TensorSpec((), int32)}; next(it) == {'x': [0, 0, 0], 'y': 1}
    s = group.strategy

    def dataset_fn(ctx):
        return [{"x": np.zeros(3, np.float32), "y": np.int32(y)} for y in (1, 2)]

    dist = s.distribute_datasets_from_function(dataset_fn)
    first = next(iter(dist))
    want = {"x": ArraySpec((3,), np.dtype(np.float32)), "y": ArraySpec((), np.dtype(np.int32))}
    ok = dist.element_spec == want and first["x"].tolist() == [0.0, 0.0, 0.0] and int(first["y"]) == 1
    all_ranks_agree(group.comm, ok, f"{dist.element_spec} {first}")


def test_make_input_fn_iterator_takes_unbatched_elements(group):
    # tf: it = make_input_fn_iterator(lambda ctx: Dataset.range(4)); it.initialize(); it.get_next() == 0
    s = group.strategy
    it = s.make_input_fn_iterator(lambda ctx: range(4))
    it.initialize()
    first, second = it.get_next(), it.get_next()
    all_ranks_agree(group.comm, (int(first), int(second)) == (0, 1), f"{first} {second}")


def test_exhausted_pipelines_of_scalars_get_tfs_dummy_element(group):
    # rank r's pipeline yields 10 r, ..., 10 r + r (r + 1 elements). tf pads an exhausted worker
    # with _dummy_tensor_fn(spec): a scalar 0 for TensorSpec((), int64) (and shape (0,) for
    # TensorSpec((3,), ...)); the epoch lasts as long as the longest pipeline.
    s = group.strategy
    n, r = group.size, group.rank
    dist = s.distribute_datasets_from_function(
        lambda ctx: [np.int64(10 * ctx.input_pipeline_id + i) for i in range(ctx.input_pipeline_id + 1)]
    )
    got = [int(x) for x in dist]
    want = [10 * r + i for i in range(r + 1)] + [0] * (n - 1 - r)
    all_ranks_agree(group.comm, got == want, f"{got} != {want}")


def test_exhausted_unbatched_vector_leaves_get_a_leading_zero_dimension(group):
    # tf: _dummy_tensor_fn({'v': TensorSpec((3,), float32), 's': TensorSpec((), int64)})
    # == {'v': zeros((0,), float32), 's': 0}
    s = group.strategy
    r = group.rank

    def dataset_fn(ctx):
        return [{"v": np.ones(3, np.float32), "s": np.int64(7)}] * (ctx.input_pipeline_id + 1)

    got = list(s.distribute_datasets_from_function(dataset_fn))
    padded = got[r + 1 :]
    ok = len(got) == group.size and all(
        p["v"].shape == (0,) and p["v"].dtype == np.float32 and int(p["s"]) == 0 and p["s"].shape == ()
        for p in padded
    )
    all_ranks_agree(group.comm, ok, repr(got))


@pytest.mark.mpi(min_size=2)
def test_uneven_drop_and_error_apply_to_unbatched_elements(world):
    s = world.strategy

    def dataset_fn(ctx):
        return list(range(ctx.input_pipeline_id + 1))

    dropped = [int(x) for x in s.distribute_datasets_from_function(dataset_fn, InputOptions(uneven="drop"))]
    all_ranks_agree(world.comm, dropped == [0], f"{dropped}")
    raises_on_every_rank(
        world.comm,
        InvalidArgumentError,
        lambda: list(s.distribute_datasets_from_function(dataset_fn, InputOptions(uneven="error"))),
        "different lengths",
    )


@pytest.mark.mpi(min_size=2)
def test_batches_on_one_rank_and_unbatched_elements_on_another_raise_everywhere(world):
    s = world.strategy

    def dataset_fn(ctx):
        return [np.arange(2)] if ctx.input_pipeline_id == 0 else [np.int64(1)]

    raises_on_every_rank(
        world.comm,
        CollectiveMismatchError,
        lambda: list(s.distribute_datasets_from_function(dataset_fn)),
        "all batches or all unbatched elements",
    )


def test_batched_pipelines_are_unchanged(group):
    # tf: Dataset.range(4).batch(2): element_spec TensorSpec((None,), int64); [0 1], [2 3]
    s = group.strategy
    dist = s.distribute_datasets_from_function(lambda ctx: [np.arange(0, 2), np.arange(2, 4)])
    got = [x.tolist() for x in dist]
    all_ranks_agree(
        group.comm,
        dist.element_spec == ArraySpec((None,), np.dtype(np.int64)) and got == [[0, 1], [2, 3]],
        f"{dist.element_spec} {got}",
    )


def test_make_input_fn_iterator_errors_name_it(group):
    s = group.strategy
    message = raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: s.make_input_fn_iterator(lambda ctx: [{"a": np.zeros(2), "b": np.zeros(3)}]).get_next(),
        "make_input_fn_iterator: the leaves of a batch have different leading",
    )
    assert "distribute_datasets_from_function" not in message


# -- experimental_distribute_dataset over unbatched elements ----------------------------------------
# tf 2.21, MirroredStrategy over one device: experimental_distribute_dataset(Dataset.range(5)) gives
# 0, 1, 2, 3, 4 (element_spec TensorSpec((), int64)); a generator of float32 scalars 0., 1., 2.; and
# from_tensor_slices({"x": arange(6.).reshape(3, 2) float32, "y": range(3)}) {"x": [0, 1], "y": 0}, ...
# Over several workers tf raises (IndexError in compute_batch_size); here replica r takes elements
# r, r + n, ... (testAutoshardingOption's order: [0], [2] and [1], [3] of range(4) at 2 workers) and a
# replica past the end of the data gets tf's dummy element (a scalar 0), as an exhausted pipeline does.


def _dealt(values, n, r, dummy):
    steps = -(-len(values) // n)
    return [values[s * n + r] if s * n + r < len(values) else dummy for s in range(steps)]


def test_unbatched_scalars_one_per_replica_per_step(group):
    s, n, r = group.strategy, group.size, group.rank
    dist = s.experimental_distribute_dataset(range(5))
    spec = dist.element_spec
    got = [x for x in dist]
    checks = RankChecks()
    checks.that(spec == ArraySpec((), np.dtype(np.int64)) and all(np.shape(x) == () for x in got))
    checks.that([int(x) for x in got] == _dealt(list(range(5)), n, r, 0))
    checks.agree(group.comm, f"{spec} {got}")


def test_unbatched_float32_scalars_from_a_generator(group):
    s, n, r = group.strategy, group.size, group.rank
    got = list(s.experimental_distribute_dataset(np.float32(i) for i in range(3)))
    ok = all(x.dtype == np.float32 for x in got) and [float(x) for x in got] == _dealt(
        [0.0, 1.0, 2.0], n, r, 0.0
    )
    all_ranks_agree(group.comm, ok, f"{got!r}")


def test_unbatched_examples_with_vector_and_scalar_leaves(group):
    s, r = group.strategy, group.rank
    x = np.arange(6.0, dtype=np.float32).reshape(3, 2)
    it = iter(s.make_dataset_iterator([{"x": x[i], "y": np.int64(i)} for i in range(3)]))
    first = it.get_next()
    want = {"x": ArraySpec((2,), np.dtype(np.float32)), "y": ArraySpec((), np.dtype(np.int64))}
    checks = RankChecks()
    checks.that(it.element_spec == want and first["x"].dtype == np.float32)
    if r < 3:
        checks.that(first["x"].tolist() == x[r].tolist() and int(first["y"]) == r)
    else:  # tf's dummy: a leading dimension of 0, a scalar 0
        checks.that(first["x"].shape == (0,) and int(first["y"]) == 0)
    checks.agree(group.comm, f"{it.element_spec} {first}")


def test_every_unbatched_element_reaches_exactly_one_replica(group):
    s, n, r = group.strategy, group.size, group.rank
    seen = [
        int(v)
        for step, v in enumerate(s.experimental_distribute_dataset(iter(range(100, 107))))
        if step * n + r < 7
    ]
    everyone = sorted(v for vs in group.comm.allgather(seen) for v in vs)
    all_ranks_agree(group.comm, everyone == list(range(100, 107)), f"{everyone}")


@pytest.mark.mpi(min_size=2)
def test_uneven_drop_and_error_apply_to_unbatched_elements_of_a_global_dataset(world):
    s, n = world.strategy, world.size
    dropped = [int(x) for x in s.experimental_distribute_dataset(range(n + 1), InputOptions(uneven="drop"))]
    all_ranks_agree(world.comm, dropped == [world.rank], f"{dropped}")
    raises_on_every_rank(
        world.comm,
        InvalidArgumentError,
        lambda: list(s.experimental_distribute_dataset(range(n + 1), InputOptions(uneven="error"))),
        "without data",
    )


@pytest.mark.mpi(min_size=2)
def test_unbatched_elements_then_a_batch_raise_everywhere(world):
    s = world.strategy
    raises_on_every_rank(
        world.comm,
        InvalidArgumentError,
        lambda: list(s.experimental_distribute_dataset([np.float32(1), np.arange(4)])),
        "all batches or all unbatched elements",
    )


@pytest.mark.mpi(min_size=2)
def test_ranks_reading_different_elements_raise_everywhere(world):
    s = world.strategy
    data = [np.int64(1)] * (world.size if world.rank else 2 * world.size)  # one step more on rank 0
    raises_on_every_rank(
        world.comm, CollectiveMismatchError, lambda: list(s.experimental_distribute_dataset(data))
    )


# -- next(iterator) inside strategy.run -------------------------------------------------------------


def _iterators(s):
    yield "distribute_dataset", iter(s.experimental_distribute_dataset([np.arange(4), np.arange(4, 8)]))
    yield "datasets_from_function", iter(s.distribute_datasets_from_function(lambda ctx: range(4)))
    dataset_it = s.make_dataset_iterator([np.arange(4), np.arange(4, 8)])
    dataset_it.initialize()
    yield "make_dataset_iterator", dataset_it
    yield "make_input_fn_iterator", s.make_input_fn_iterator(lambda ctx: range(4))


@pytest.mark.parametrize("kind", ["next", "get_next", "for"])
def test_next_inside_run_raises_tfs_value_error_on_every_rank(group, kind):
    # tf: strategy.run(lambda: next(it)) raises ValueError(NEXT_IN_RUN); the iterator did not move:
    # next(it) afterwards gives the first element (range(4).batch(2): [0 1]).
    s = group.strategy
    read = {"next": next, "get_next": lambda it: it.get_next(), "for": lambda it: [x for x in it]}[kind]
    for name, it in _iterators(s):
        message = raises_on_every_rank(group.comm, ValueError, lambda it=it: s.run(lambda: read(it)))
        assert message == NEXT_IN_RUN, (name, message)
        first = next(it)
        want = 0 if name in ("datasets_from_function", "make_input_fn_iterator") else None
        if want is None:
            # the split of [0 1 2 3] across n replicas: replica r's part
            n, r = group.size, group.rank
            per = -(-4 // n)
            want_list = list(range(4))[r * per : (r + 1) * per]
            all_ranks_agree(group.comm, np.asarray(first).tolist() == want_list, f"{name} {first}")
        else:
            all_ranks_agree(group.comm, int(first) == want, f"{name} {first}")
    with s.scope():
        it = iter(s.distribute_datasets_from_function(lambda ctx: range(4)))
        raises_on_every_rank(group.comm, ValueError, lambda: s.run(lambda: read(it)), NEXT_IN_RUN)


def test_next_outside_any_scope_and_in_the_scope_is_fine(group):
    # tf: next(it) outside strategy.scope() and inside it both read the element.
    s = group.strategy
    it = iter(s.distribute_datasets_from_function(lambda ctx: range(4)))
    first = next(it)
    with s.scope():
        second = next(it)
    all_ranks_agree(group.comm, (int(first), int(second)) == (0, 1), f"{first} {second}")


def test_next_in_the_default_strategys_replica_context_is_fine():
    # outside any scope get_replica_context() is the default replica context; tf enters the
    # iterator's strategy there and reads.
    s = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
    it = iter(s.distribute_datasets_from_function(lambda ctx: range(2)))
    assert mpistrat.get_replica_context() is not None
    assert int(next(it)) == 0
