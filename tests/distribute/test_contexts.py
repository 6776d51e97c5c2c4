"""Replica vs cross-replica context, default strategy, and the errors tf.distribute raises."""

import numpy as np
import pytest

import mpistrat
from mpistrat import ContextError
from tests.conftest import raises_on_every_rank

HINT = "use get_replica_context().merge_call()"


def test_default_context_outside_any_scope():
    assert not mpistrat.has_strategy()
    assert not mpistrat.in_cross_replica_context()
    assert mpistrat.get_cross_replica_context() is None
    ctx = mpistrat.get_replica_context()
    assert ctx is not None and ctx.replica_id_in_sync_group == 0 and ctx.num_replicas_in_sync == 1
    assert ctx.strategy is mpistrat.get_strategy()
    assert ctx.all_reduce("mean", {"a": 1, "b": [40, 1]}) == {"a": 1.0, "b": [40.0, 1.0]}


def test_scope_enters_cross_replica_context(world):
    strategy = world.strategy
    with strategy.scope():
        assert mpistrat.has_strategy()
        assert mpistrat.get_strategy() is strategy
        assert mpistrat.in_cross_replica_context()
        assert mpistrat.get_cross_replica_context() is strategy
        assert mpistrat.get_replica_context() is None
        with strategy.scope():  # re-entrant
            assert mpistrat.get_strategy() is strategy
    assert not mpistrat.has_strategy()


def test_run_enters_replica_context(world):
    def step():
        ctx = mpistrat.get_replica_context()
        return (
            mpistrat.in_cross_replica_context(),
            mpistrat.get_cross_replica_context(),
            ctx.strategy,
            ctx.devices,
        )

    cross, cross_ctx, strategy, devices = world.strategy.run(step)
    assert not cross and cross_ctx is None and strategy is world.strategy
    assert devices == (f"/job:worker/replica:0/task:{world.rank}/device:CPU:0",)


def test_replica_context_as_context_manager(world):
    ctx = mpistrat.ReplicaContext(world.strategy, world.rank)
    with ctx:
        assert mpistrat.get_replica_context() is ctx
        assert mpistrat.get_strategy() is world.strategy
    assert mpistrat.get_replica_context() is not ctx


def test_replica_methods_in_cross_replica_context_raise(world):
    with world.strategy.scope():
        ctx = mpistrat.ReplicaContext(world.strategy, world.rank)
        for call in (
            lambda: ctx.all_reduce("sum", 1),
            lambda: ctx.all_gather(np.ones(1), 0),
            lambda: ctx.merge_call(print),
        ):
            with pytest.raises(ContextError, match="replica context"):
                call()


def test_cross_replica_methods_in_replica_context_raise(world):
    strategy = world.strategy

    def step():
        for call in (
            lambda: strategy.reduce("sum", 1.0),
            lambda: strategy.gather(np.ones(1), 0),
            lambda: strategy.run(lambda: None),
            lambda: strategy.scope().__enter__(),
        ):
            with pytest.raises(ContextError, match=HINT.replace("(", r"\(").replace(")", r"\)")):
                call()
        return True

    assert strategy.run(step)


def test_mixing_strategies_is_an_error(world):
    # tf 2.21: RuntimeError("Mixing different tf.distribute.Strategy objects: ...")
    other = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
    with world.strategy.scope(), pytest.raises(RuntimeError, match="Mixing different"), other.scope():
        pass


def test_communicating_in_run_inside_merge_fn_is_an_error(world):
    def merge_fn(strategy):
        strategy.run(lambda: mpistrat.get_replica_context().all_gather(np.ones(1), axis=0))

    raises_on_every_rank(
        world.comm,
        ContextError,
        lambda: world.strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn)),
        match="merge_fn",
    )


def test_finalize_then_use_is_an_error():
    strategy = mpistrat.MPIStrategy()
    assert strategy.experimental_initialize() == []
    assert strategy.experimental_finalize() == []
    with pytest.raises(ContextError, match="finalized"):
        strategy.run(lambda: None)
    with pytest.raises(ContextError, match="finalized"), strategy.scope():
        pass


def test_update_config_proto_returns_an_updated_copy(world):
    config = {"allow_soft_placement": True, "experimental": {"x": 1}}
    updated = world.strategy.update_config_proto(config)
    assert config == {"allow_soft_placement": True, "experimental": {"x": 1}}
    assert updated["allow_soft_placement"] is True
    assert updated["device_filters"] == [f"/job:worker/task:{world.rank}"]
    assert updated["experimental"] == {"x": 1, "collective_group_leader": "/job:worker/replica:0/task:0"}
    with pytest.raises(TypeError):
        world.strategy.update_config_proto(["not", "a", "mapping"])


def test_experimental_run_v2_is_run(world):
    assert world.strategy.experimental_run_v2(lambda x: x + 1, args=(1,)) == 2


def test_run_unwraps_per_replica_arguments(group):
    per_replica = mpistrat.PerReplica(tuple(range(100, 100 + group.size)))
    got = group.strategy.run(
        lambda x, y: (x, y), args=(per_replica,), kwargs={"y": mpistrat.Mirrored((7,) * group.size)}
    )
    assert got == (100 + group.rank, 7)


def test_experimental_local_results(world):
    assert world.strategy.experimental_local_results(5) == (5,)
    assert world.strategy.experimental_local_results(mpistrat.PerReplica((1, 2))) == (1, 2)


def test_bad_communicator_is_a_type_error():
    with pytest.raises(TypeError, match="intracommunicator"):
        mpistrat.MPIStrategy("COMM_WORLD")
