"""The examples of the reference pages (shared/seeds), at every size the suite runs.

Where a seed example is written for two replicas, replica ``r`` takes the seed's
value for replica ``r % 2`` and the expectation is a serial NumPy computation of
the same data; with exactly two replicas it is the seed's printed result.
"""

import numpy as np
import pytest

import mpistrat
from mpistrat import ReduceOp
from tests.conftest import RankChecks, all_ranks_agree

SEED_ALL_REDUCE = [{"a": 1, "b": [40, 1]}, {"a": 3, "b": [2, 98]}]
SEED_GATHER = [
    {"a": np.array([0]), "b": np.array([[0, 1]])},
    {"a": np.array([1]), "b": np.array([[2, 3], [4, 5]])},
]


def serial(op, values):
    total = sum(np.asarray(v) for v in values)
    return total / len(values) if op == "MEAN" else total


@pytest.mark.parametrize("op", ["SUM", "MEAN", "sum", ReduceOp.MEAN])
def test_nested_all_reduce(group, op):
    name = ReduceOp.from_any(op).value
    values = [SEED_ALL_REDUCE[r % 2] for r in range(group.size)]

    def step():
        ctx = mpistrat.get_replica_context()
        return ctx.all_reduce(op, SEED_ALL_REDUCE[ctx.replica_id_in_sync_group % 2])

    got = group.strategy.run(step)
    want = {
        "a": serial(name, [v["a"] for v in values]),
        "b": [serial(name, [v["b"][i] for v in values]) for i in range(2)],
    }
    checks = RankChecks()
    checks.that(got["a"] == want["a"] and got["b"] == want["b"])
    if group.size == 2:  # the seed's printed result
        seed = {"SUM": {"a": 4, "b": [42, 99]}, "MEAN": {"a": 2, "b": [21, 49.5]}}[name]
        checks.that(got == seed)
    checks.agree(group.comm, f"{got} != {want}")


def test_all_reduce_scalar_and_batched(group):
    def step():
        ctx = mpistrat.get_replica_context()
        return ctx.all_reduce(ReduceOp.SUM, np.float32(1.0)), ctx.all_reduce(
            "SUM", [np.float32(1.0), np.float32(2.0)]
        )

    single, batched = group.strategy.run(step)
    n = group.size
    ok = single == n and single.dtype == np.float32 and batched == [n * 1.0, n * 2.0]
    all_ranks_agree(group.comm, ok, f"{single!r} {batched!r}")


def test_all_gather_single_tensor_and_list(group):
    def step():
        ctx = mpistrat.get_replica_context()
        return (
            ctx.all_gather(np.array([1, 2, 3], dtype=np.int32), axis=0),
            ctx.all_gather([np.array([1, 2, 3]), np.array([[1, 2], [3, 4]])], axis=0),
        )

    single, (v1, v2) = group.strategy.run(step)
    n = group.size
    ok = (
        np.array_equal(single, np.tile([1, 2, 3], n))
        and single.dtype == np.int32
        and np.array_equal(v1, np.tile([1, 2, 3], n))
        and np.array_equal(v2, np.tile([[1, 2], [3, 4]], (n, 1)))
    )
    all_ranks_agree(group.comm, ok, f"{single} {v1} {v2}")


def test_all_gather_uneven_along_axis(group):
    def step():
        ctx = mpistrat.get_replica_context()
        return ctx.all_gather(SEED_GATHER[ctx.replica_id_in_sync_group % 2], axis=0)

    got = group.strategy.run(step)
    parts = [SEED_GATHER[r % 2] for r in range(group.size)]
    want = {k: np.concatenate([p[k] for p in parts]) for k in ("a", "b")}
    checks = RankChecks()
    checks.that(all(np.array_equal(got[k], want[k]) for k in want))
    if group.size == 2:
        checks.that(got["a"].tolist() == [0, 1] and got["b"].tolist() == [[0, 1], [2, 3], [4, 5]])
    checks.agree(group.comm, f"{got}")


def test_all_gather_along_middle_axis_as_the_seed_describes(group):
    # "component tensors of shape (1, 2, 3) and (1, 3, 3) ... all_gather(..., axis=1)"
    def step():
        r = mpistrat.get_replica_context().replica_id_in_sync_group
        local = np.arange(9 if r % 2 else 6, dtype=np.float64).reshape(1, 3 if r % 2 else 2, 3) + 100 * r
        return local, mpistrat.get_replica_context().all_gather(local, axis=-2)

    _, got = group.strategy.run(step)
    parts = [
        np.arange(9 if r % 2 else 6, dtype=np.float64).reshape(1, 3 if r % 2 else 2, 3) + 100 * r
        for r in range(group.size)
    ]
    all_ranks_agree(group.comm, np.array_equal(got, np.concatenate(parts, axis=1)), f"{got}")


def test_replica_id_is_the_rank(group):
    ids = group.strategy.run(lambda: mpistrat.get_replica_context().replica_id_in_sync_group)
    ctx_n = group.strategy.run(lambda: mpistrat.get_replica_context().num_replicas_in_sync)
    all_ranks_agree(group.comm, ids == group.rank and ctx_n == group.size, f"{ids} {ctx_n}")
    all_ranks_agree(group.comm, group.strategy.num_replicas_in_sync == group.size)


def test_merge_call_outside_a_distributed_scope_is_a_plain_call():
    # "If not inside a distributed scope, this is equivalent to: strategy = get_strategy(); with
    # cross-replica-context(strategy): return merge_fn(strategy, *args, **kwargs)"
    seen = {}

    def merge_fn(strategy, x, *, y):
        seen["strategy"] = strategy
        seen["cross"] = mpistrat.in_cross_replica_context()
        return x + y

    assert mpistrat.get_replica_context().merge_call(merge_fn, args=(1,), kwargs={"y": 2}) == 3
    assert seen == {"strategy": mpistrat.get_strategy(), "cross": True}
    assert not mpistrat.in_cross_replica_context()


def test_merge_call_joins_replicas_and_unpacks_per_replica_results(group):
    n = group.size

    def merge_fn(strategy, value, label, *, scale):
        assert mpistrat.in_cross_replica_context()
        assert isinstance(value, mpistrat.PerReplica) and len(value.values) == n
        total = strategy.reduce("SUM", value)  # local arithmetic on rank 0
        parts = strategy.experimental_local_results(value)
        ids = mpistrat.PerReplica(tuple(10 * i for i in range(n)))
        return total * scale, [np.asarray(p) for p in parts], ids, label

    def step():
        r = mpistrat.get_replica_context().replica_id_in_sync_group
        return mpistrat.get_replica_context().merge_call(
            merge_fn, args=(np.array([r, 1.0]), "same"), kwargs={"scale": 2}
        )

    total, parts, mine, label = group.strategy.run(step)
    want_total = 2 * np.array([sum(range(n)), n], dtype=float)
    ok = (
        np.array_equal(total, want_total)
        and [p.tolist() for p in parts] == [[r, 1.0] for r in range(n)]
        and mine == 10 * group.rank
        and label == "same"
    )
    all_ranks_agree(group.comm, ok, f"{total} {parts} {mine} {label}")


def test_merge_call_exception_reaches_every_rank_and_the_next_collective_works(group):
    from tests.conftest import raises_on_every_rank

    def merge_fn(strategy, x):
        raise KeyError(f"bad key {len(strategy.experimental_local_results(x))}")

    def step():
        return mpistrat.get_replica_context().merge_call(merge_fn, args=(np.ones(2),))

    raises_on_every_rank(
        group.comm, KeyError, lambda: group.strategy.run(step), match=f"bad key {group.size}"
    )
    after = group.strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1))
    all_ranks_agree(group.comm, after == group.size)


@pytest.mark.parametrize("check", [True, False])
def test_merge_call_with_unpicklable_arguments_or_result_raises_everywhere(group, check):
    from tests.conftest import raises_on_every_rank

    opts = mpistrat.CommunicationOptions(check=check)
    strategy = mpistrat.MPIStrategy(group.comm, communication_options=opts)
    last = group.size - 1

    def bad_args():
        r = mpistrat.get_replica_context().replica_id_in_sync_group
        arg = (lambda: r) if r == last else r  # a lambda cannot be pickled
        return mpistrat.get_replica_context().merge_call(lambda s, x: 0, args=(arg,))

    def bad_result():
        return mpistrat.get_replica_context().merge_call(lambda s: lambda: None)

    if group.size > 1:
        raises_on_every_rank(group.comm, TypeError, lambda: strategy.run(bad_args), match=f"rank {last}")
    raises_on_every_rank(group.comm, TypeError, lambda: strategy.run(bad_result), match="cannot be pickled")
    after = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1))
    all_ranks_agree(group.comm, after == group.size)
    strategy.experimental_finalize()
