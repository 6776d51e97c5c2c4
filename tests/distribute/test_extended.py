"""StrategyExtended: every member of the reference page, its context rules and its errors."""

import numpy as np
import pytest

import mpistrat
from mpistrat import ContextError, InvalidArgumentError, ReduceOp, VariableAggregation
from tests.conftest import RankChecks, all_ranks_agree, raises_on_every_rank

HINT = "use get_replica_context().merge_call()"


def local_value(rank):
    return np.array([rank + 1.0, 10.0 * (rank + 1)])


def serial(op, n):
    total = sum(local_value(r) for r in range(n))
    return total / n if op in ("MEAN", ReduceOp.MEAN) else total


def test_properties(group):
    ext = group.strategy.extended
    assert ext.experimental_require_static_shapes is False
    assert (
        ext.parameter_devices
        == ext.worker_devices
        == (f"/job:worker/replica:0/task:{group.rank}/device:CPU:0",)
    )
    assert ext.non_slot_devices([]) == ext.parameter_devices


@pytest.mark.parametrize("op", ["SUM", "MEAN", ReduceOp.SUM, VariableAggregation.MEAN])
def test_reduce_to_in_cross_replica_context(group, op):
    with group.strategy.scope():
        var = mpistrat.Variable(np.zeros(2))
        got = group.strategy.extended.reduce_to(op, local_value(group.rank), destinations=var)
    name = getattr(op, "name", op)
    all_ranks_agree(group.comm, np.allclose(got, serial(name, group.size)), f"{got}")


def test_reduce_to_only_first_replica_and_mirrored_values(group):
    ext = group.strategy.extended
    with group.strategy.scope():
        first = ext.reduce_to(
            VariableAggregation.ONLY_FIRST_REPLICA, local_value(group.rank), "/device:CPU:0"
        )
        mirrored_sum = ext.reduce_to("SUM", mpistrat.Mirrored((np.float64(2.0),) * group.size), "/cpu:0")
        own = ext.reduce_to("MEAN", float(group.rank), float(group.rank))  # "pass value to destinations"
    checks = RankChecks()
    checks.that(np.array_equal(first, local_value(0)) and mirrored_sum == 2.0 * group.size)
    checks.that(own == sum(range(group.size)) / group.size)
    checks.agree(group.comm, f"{first} {mirrored_sum}")


def test_batch_reduce_to_is_one_fused_collective(group):
    ext = group.strategy.extended
    with group.strategy.scope():
        dest = mpistrat.Variable(np.zeros(2))
        pairs = [
            (local_value(group.rank), dest),
            (np.float32(group.rank), dest),
            (np.arange(3) * group.rank, dest),
        ]
        before = ext.collectives.seq
        out = ext.batch_reduce_to("SUM", pairs)
        handshakes = ext.collectives.seq - before
    n = group.size
    want = [serial("SUM", n), np.float32(sum(range(n))), np.arange(3) * sum(range(n))]
    checks = RankChecks()
    checks.that(handshakes == 1 and all(np.array_equal(o, w) for o, w in zip(out, want, strict=True)))
    checks.that(out[1].dtype == np.float32 and out[2].dtype == np.arange(3).dtype)
    checks.agree(group.comm, f"{handshakes} {out}")


def test_reductions_inside_merge_fn_are_local(group):
    n = group.size

    def merge_fn(strategy, value):
        ext = strategy.extended
        seq = ext.collectives.seq
        one = ext.reduce_to("MEAN", value, destinations=value)
        both = ext.batch_reduce_to("SUM", [(value, value), (value, value)])
        assert ext.collectives.seq == seq  # no MPI inside merge_fn
        assert isinstance(one, mpistrat.Mirrored) and len(one.values) == n
        return one, both[0]

    def step():
        rid = mpistrat.get_replica_context().replica_id_in_sync_group
        return mpistrat.get_replica_context().merge_call(merge_fn, args=(local_value(rid),))

    mean, total = group.strategy.run(step)  # Mirrored results arrive as their value
    ok = np.allclose(mean, serial("MEAN", n)) and np.allclose(total, serial("SUM", n))
    all_ranks_agree(group.comm, ok, f"{mean} {total}")


def test_cross_replica_methods_in_replica_context_raise(world):
    ext = world.strategy.extended
    with world.strategy.scope():
        var = mpistrat.Variable(1.0)

    def step():
        calls = [
            lambda: ext.reduce_to("SUM", 1.0, var),
            lambda: ext.batch_reduce_to("SUM", [(1.0, var)]),
            lambda: ext.update_non_slot(ext.non_slot_devices([var]), lambda: None),
            lambda: ext.broadcast_to(1.0, var),
            lambda: ext.call_for_each_replica(lambda: None),
        ]
        for call in calls:
            with pytest.raises(ContextError, match=HINT.replace("(", r"\(").replace(")", r"\)")):
                call()
        return True

    assert world.strategy.run(step)


def test_argument_errors(world):
    ext = world.strategy.extended
    plain = mpistrat.Variable(1.0)
    with world.strategy.scope():
        var = mpistrat.Variable(1.0)
        for bad in (None, [var], ""):
            with pytest.raises(InvalidArgumentError, match="destinations"):
                ext.reduce_to("SUM", 1.0, bad)
        with pytest.raises(InvalidArgumentError, match="reduce_op"):
            ext.reduce_to("MAX", 1.0, var)
        with pytest.raises(InvalidArgumentError, match="pair"):
            ext.batch_reduce_to("SUM", [1.0])
        too_many = mpistrat.PerReplica(tuple(range(world.size + 1)))
        with pytest.raises(InvalidArgumentError, match="components"):
            ext.update(var, lambda v, x: v.assign(x), args=(too_many,))
        with pytest.raises(InvalidArgumentError, match="scope"):
            ext.update(plain, lambda v: v)


def test_update_and_seed_colocation_example(group):
    strategy = group.strategy
    with strategy.scope():
        var1 = mpistrat.Variable(1.0)
        with strategy.extended.colocate_vars_with(var1):
            var2 = mpistrat.Variable(2.0)
            var3 = mpistrat.Variable(3.0)
    assert var2.colocated_with is var1 and var3.colocated_with is var1 and var1.colocated_with is None

    def fn(v1, v2, v3):  # each is this rank's copy of the variable
        assert v1 in strategy.experimental_local_results(var1)
        assert strategy.extended.value_container(v2) is var2
        v2.assign_add(v1.value())
        v3.assign_add(v1.value())
        return v1.assign_add(10.0).value()

    with strategy.scope():
        grouped = strategy.extended.update(var1, fn, args=(var2, var3))
        ungrouped = strategy.extended.update(var1, lambda v: v.value() * 1, group=False)
    got = (float(grouped), ungrouped, float(var1.numpy()), float(var2.numpy()), float(var3.numpy()))
    all_ranks_agree(group.comm, got == (11.0, (11.0,), 11.0, 3.0, 4.0), f"{got}")


def test_update_inside_merge_fn_reaches_every_rank(group):
    strategy = group.strategy
    with strategy.scope():
        var = mpistrat.Variable(np.zeros(2))
        counter = mpistrat.Variable(np.int64(0))

    def merge_fn(strategy, value):
        ext = strategy.extended
        total = ext.reduce_to("SUM", value, destinations=var)
        ext.update(var, lambda v, t: v.assign(t), args=(total,))
        ext.update_non_slot(ext.non_slot_devices([var]), lambda: counter.assign_add(1))

    for _ in range(2):
        strategy.run(
            lambda: mpistrat.get_replica_context().merge_call(merge_fn, args=(local_value(group.rank),))
        )
    ok = np.array_equal(var.numpy(), serial("SUM", group.size)) and int(counter.numpy()) == 2
    all_ranks_agree(group.comm, ok, f"{var!r} {counter!r}")


def test_colocate_vars_with_rules(world):
    ext = world.strategy.extended
    plain, plain_array = mpistrat.Variable(1.0), mpistrat.Variable(np.ones(3))
    with world.strategy.scope():
        var = mpistrat.Variable(1.0)
    with pytest.raises(ContextError, match=r'Need to be inside "with strategy\.scope\(\)"'):
        ext.colocate_vars_with(var)
    other = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
    with other.scope(), pytest.raises(ContextError, match="Mixing different"):
        ext.colocate_vars_with(var)
    with world.strategy.scope():
        for outsider in (plain, plain_array):  # an array's != is no truth value
            with pytest.raises(InvalidArgumentError, match="created in this strategy"):
                ext.colocate_vars_with(outsider)
        block = ext.colocate_vars_with(ext.non_slot_devices([var]))
    with block, pytest.raises(ContextError, match="scope"):
        mpistrat.Variable(1.0)  # created outside the scope, inside the colocation block


def test_value_container_and_variable_created_in_scope(world):
    strategy = world.strategy
    with strategy.scope():
        var = mpistrat.Variable(1.0)
    plain = mpistrat.Variable(1.0)
    (copy,) = strategy.experimental_local_results(var)
    assert strategy.extended.value_container(copy) is var and strategy.extended.value_container(var) is var
    assert strategy.extended.value_container(5) == 5
    assert copy in strategy.experimental_local_results(strategy.extended.value_container(copy))
    assert strategy.extended.variable_created_in_scope(var)
    assert not strategy.extended.variable_created_in_scope(plain)
    default = mpistrat.get_strategy()
    assert default.extended.variable_created_in_scope(plain)
    assert not default.extended.variable_created_in_scope(var)
    with pytest.raises(InvalidArgumentError, match="Variable"):
        strategy.extended.variable_created_in_scope(1.0)


def test_call_for_each_replica_and_broadcast_to(group):
    ext = group.strategy.extended
    rid = ext.call_for_each_replica(
        lambda x: mpistrat.get_replica_context().replica_id_in_sync_group + x, (100,)
    )
    with group.strategy.scope():
        value = ext.broadcast_to(local_value(group.rank), destinations="/device:CPU:0")
    ok = rid == 100 + group.rank and np.array_equal(value, local_value(0))
    all_ranks_agree(group.comm, ok, f"{rid} {value}")


def test_default_strategy_extended():
    default = mpistrat.get_strategy()
    ext = default.extended
    var = mpistrat.Variable(1.0)
    assert ext.reduce_to("SUM", 2.0, var) == 2.0
    assert ext.batch_reduce_to("MEAN", [(2.0, var)]) == [2.0]
    assert ext.update(var, lambda v, x: v.assign_add(x), args=(mpistrat.Mirrored((1.0,)),)) is var
    assert float(var.numpy()) == 2.0
    with ext.colocate_vars_with(var):
        assert mpistrat.Variable(0.0).colocated_with is var


def test_mismatched_reduce_to_fails_every_rank(group):
    if group.size == 1:
        pytest.skip("needs two ranks to disagree")

    def call():
        with group.strategy.scope():
            group.strategy.extended.reduce_to("SUM", np.zeros(1 + group.rank), "/cpu:0")

    raises_on_every_rank(group.comm, mpistrat.CollectiveMismatchError, call, "reduce_to")
