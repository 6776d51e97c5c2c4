"""TensorFlow's ``strategy_gather_test.py`` (``GatherTest``), the cases for a multi-worker strategy.

Ported from tensorflow/python/distribute/strategy_gather_test.py (TF 2.21), which runs them on
``multi_worker_mirrored_2x1_cpu`` (2 workers of one replica, as 2 ranks here) among others.
Expected values are TF's: the concatenation of the replicas' values along ``axis``, written as a
formula of ``n`` replicas. ``pure_eager`` True/False is one case here (no ``tf.function``).

Not ported: the ``IndexedSlices`` cases (``testGatherRaiseSparse``, ``testAllGatherRaiseSparse``:
there is no sparse value type here), the gradient cases (``testAllGatherGradient*``: no autodiff)
and the TPU-only ``testAllGatherDiffValueTPU``. TF's error for shapes that differ off ``axis`` or
in rank is ``InvalidArgumentError`` ("Shape mismatch"); mpistrat's is ``CollectiveMismatchError``,
a ``ValueError`` like TF's, on every rank.
"""

import numpy as np
import pytest

import mpistrat
from tests.conftest import all_ranks_agree, raises_on_every_rank

SAME_SHAPE = {
    # test name: (value on every replica, axis)
    "1D0Axis": (np.array([1, 2, 3], np.int32), 0),  # (3,) -> (3 n,)
    "2D0Axis": (np.array([[1, 2, 3]], np.int32), 0),  # (1, 3) -> (n, 3)
    "2D1Axis": (np.array([[1, 2, 3]], np.int32), 1),  # (1, 3) -> (1, 3 n)
    "3D0Axis": (np.array([[[1, 2], [1, 2]]], np.int32), 0),  # (1, 2, 2) -> (n, 2, 2)
    "3D1Axis": (np.array([[[1, 2], [1, 2]]], np.int32), 1),  # (1, 2, 2) -> (1, 2 n, 2)
    "3D2Axis": (np.array([[[1, 2], [1, 2]]], np.int32), 2),  # (1, 2, 2) -> (1, 2, 2 n)
}


def _expect_same(value, axis, n):
    return np.concatenate([value] * n, axis=axis)


def _ones(shape):
    return np.ones(shape, np.int32)


@pytest.mark.parametrize("case", list(SAME_SHAPE))
def test_gather_per_replica_dense(group, case):
    # testGatherPerReplicaDense{case}: strategy.gather(values_from_function(identity(v)), axis)
    s, n = group.strategy, group.size
    value, axis = SAME_SHAPE[case]
    distributed = s.experimental_distribute_values_from_function(lambda _: value.copy())
    got = s.gather(distributed, axis=axis)
    want = _expect_same(value, axis, n)
    all_ranks_agree(group.comm, np.array_equal(got, want) and got.shape == want.shape, f"{got}")


def test_gather_diff_shape_at_axis0(group):
    # testGatherDiffShapeAtAxis0: replica r holds ones((r + 1, 1)); gather axis 0 -> ones((n(n+1)/2, 1))
    s, n = group.strategy, group.size
    distributed = s.experimental_distribute_values_from_function(
        lambda ctx: _ones((ctx.replica_id_in_sync_group + 1, 1))
    )
    got = s.gather(distributed, axis=0)
    all_ranks_agree(group.comm, np.array_equal(got, _ones((sum(range(n + 1)), 1))), f"{got}")


def test_gather_diff_shape_at_axis1(group):
    # testGatherDiffShapeAtAxis1: ones((1, r + 1)); gather axis 1 -> ones((1, n(n+1)/2))
    s, n = group.strategy, group.size
    distributed = s.experimental_distribute_values_from_function(
        lambda ctx: _ones((1, ctx.replica_id_in_sync_group + 1))
    )
    got = s.gather(distributed, axis=1)
    all_ranks_agree(group.comm, np.array_equal(got, _ones((1, sum(range(n + 1))))), f"{got}")


@pytest.mark.mpi(min_size=2)
def test_gather_raise_diff_shape_at_non_axis(world):
    # testGatherRaiseDiffShapeAtNonAxis: ones((1, r + 1)) gathered along 0 raises
    # (tf: InvalidArgumentError "Shape mismatch")
    s = world.strategy
    distributed = s.experimental_distribute_values_from_function(
        lambda ctx: _ones((1, ctx.replica_id_in_sync_group + 1))
    )
    raises_on_every_rank(world.comm, ValueError, lambda: s.gather(distributed, axis=0))


@pytest.mark.mpi(min_size=2)
def test_gather_raise_different_rank(world):
    # testGatherRaiseDifferentRank: ones(range(1, r + 2)) (rank r + 1) gathered along 0 raises
    s = world.strategy
    distributed = s.experimental_distribute_values_from_function(
        lambda ctx: np.ones(tuple(range(1, ctx.replica_id_in_sync_group + 2)))
    )
    raises_on_every_rank(world.comm, ValueError, lambda: s.gather(distributed, axis=0))


@pytest.mark.parametrize("case", list(SAME_SHAPE))
def test_all_gather_per_replica_dense(group, case):
    # testAllGatherPerReplicaDense{case}: ctx.all_gather(identity(v), axis) in replica_fn; every
    # local result is the concatenation (1D0Axis is float32 in TF; the others int32)
    s, n = group.strategy, group.size
    value, axis = SAME_SHAPE[case]
    if case == "1D0Axis":
        value = value.astype(np.float32)
    per_replica = s.experimental_distribute_values_from_function(lambda _: value.copy())

    def replica_fn(v):
        return mpistrat.get_replica_context().all_gather(np.asarray(v), axis=axis)

    result = s.experimental_local_results(s.run(replica_fn, args=(per_replica,)))
    want = _expect_same(value, axis, n)
    ok = all(np.array_equal(r, want) and r.dtype == value.dtype for r in result)
    all_ranks_agree(group.comm, ok, f"{result}")


def test_all_gather_diff_shape_at_axis0(group):
    # testAllGatherDiffShapeAtAxis0: ones((r + 1, 1)), all_gather axis 0 -> ones((n(n+1)/2, 1))
    s, n = group.strategy, group.size
    per_replica = s.experimental_distribute_values_from_function(
        lambda ctx: _ones((ctx.replica_id_in_sync_group + 1, 1))
    )
    result = s.run(lambda v: mpistrat.get_replica_context().all_gather(v, axis=0), args=(per_replica,))
    all_ranks_agree(group.comm, np.array_equal(result, _ones((sum(range(n + 1)), 1))), f"{result}")


def test_all_gather_diff_shape_at_axis1(group):
    # testAllGatherDiffShapeAtAxis1: ones((1, r + 1)), all_gather axis 1 -> ones((1, n(n+1)/2))
    s, n = group.strategy, group.size
    per_replica = s.experimental_distribute_values_from_function(
        lambda ctx: _ones((1, ctx.replica_id_in_sync_group + 1))
    )
    result = s.run(lambda v: mpistrat.get_replica_context().all_gather(v, axis=1), args=(per_replica,))
    all_ranks_agree(group.comm, np.array_equal(result, _ones((1, sum(range(n + 1))))), f"{result}")


def test_all_gather_nest(group):
    # testAllGatherNest: all_gather([ones((1, r + 1)), [[[1, 2], [1, 2]]]], axis=1):
    # [ones((1, n(n+1)/2)), concat of n copies of value_2 along 1]
    s, n = group.strategy, group.size
    value_2 = np.array([[[1, 2], [1, 2]]], np.int32)
    per_replica = s.experimental_distribute_values_from_function(
        lambda ctx: _ones((1, ctx.replica_id_in_sync_group + 1))
    )

    def run(value):
        return mpistrat.get_replica_context().all_gather([value, value_2.copy()], axis=1)

    first, second = s.run(run, args=(per_replica,))
    ok = np.array_equal(first, _ones((1, sum(range(n + 1))))) and np.array_equal(
        second, np.concatenate([value_2] * n, axis=1)
    )
    all_ranks_agree(group.comm, ok, f"{first} {second}")


def test_all_gather_nest_1d_0axis(group):
    # testAllGatherNest1D0Axis: all_gather([v, v], axis=0) of [1, 2, 3]: each is [1, 2, 3] * n
    s, n = group.strategy, group.size
    single = np.array([1, 2, 3], np.int32)
    result = s.run(lambda: mpistrat.get_replica_context().all_gather([single, single], axis=0))
    want = np.concatenate([single] * n)
    all_ranks_agree(
        group.comm, len(result) == 2 and all(np.array_equal(r, want) for r in result), f"{result}"
    )


@pytest.mark.mpi(min_size=2)
def test_all_gather_raise_diff_shape_at_non_axis(world):
    # testAllGatherRaiseDiffShapeAtNonAxis: ones((1, r + 1)) all_gathered along 0 raises
    s = world.strategy
    per_replica = s.experimental_distribute_values_from_function(
        lambda ctx: _ones((1, ctx.replica_id_in_sync_group + 1))
    )
    raises_on_every_rank(
        world.comm,
        ValueError,
        lambda: s.run(lambda v: mpistrat.get_replica_context().all_gather(v, axis=0), args=(per_replica,)),
    )


@pytest.mark.mpi(min_size=2)
def test_all_gather_raise_different_rank(world):
    # testAllGatherRaiseDifferentRank: ones(range(1, r + 2)) all_gathered along 0 raises
    s = world.strategy
    per_replica = s.experimental_distribute_values_from_function(
        lambda ctx: np.ones(tuple(range(1, ctx.replica_id_in_sync_group + 2)))
    )
    raises_on_every_rank(
        world.comm,
        ValueError,
        lambda: s.run(lambda v: mpistrat.get_replica_context().all_gather(v, axis=0), args=(per_replica,)),
    )
