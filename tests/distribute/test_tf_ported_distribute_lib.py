"""TensorFlow's ``distribute_lib_test.py``, ported to a multi-worker strategy.

Ported from tensorflow/python/distribute/distribute_lib_test.py (TF 2.21). TF runs these on
``_TestStrategy``, a one-replica strategy of its own whose variable creator returns a dict of
the creation arguments, whose ``merge_call`` returns ``kwargs["test_arg"]`` and whose reductions
return their input. Here ``dist`` is an ``MPIStrategy`` (``group``); where the test strategy's
answer is an artefact of that stub, the expected value is what TF's ``MultiWorkerMirroredStrategy``
answers instead (checked with tensorflow-cpu 2.21): reductions of a plain value give ``n`` for
SUM (each worker's value counts) and the value for MEAN, and ``update`` hands ``fn`` the replica's
component of the variable (``v._primary``), not ``v``.

Not ported: the device / variable-creator / variable-scope nesting errors (TF graph scopes),
``experimental_make_numpy_dataset`` and ``experimental_run_steps_on_iterator`` (V1 only), the
AutoGraph cases, ``testV1``, and setting ``extended._cluster_resolver`` (private).
"""

import numpy as np
import pytest

import mpistrat
from mpistrat import MPI, ContextError, InvalidArgumentError, ReduceOp
from mpistrat.interface import modes as ds_context
from tests.conftest import all_ranks_agree


def _assert_in_default_state():
    # _assert_in_default_state: the default replica context, no cross-replica context, the
    # default strategy, has_strategy() False
    assert mpistrat.get_replica_context() is ds_context.default_strategy().extended.default_replica_context
    assert mpistrat.get_cross_replica_context() is None
    assert not mpistrat.in_cross_replica_context()
    assert mpistrat.get_strategy() is ds_context.default_strategy()
    assert not mpistrat.has_strategy()


_OTHER: list = []


def another_strategy():
    """A second strategy (over COMM_SELF: creating it involves no other rank)."""
    if not _OTHER:
        _OTHER.append(mpistrat.MPIStrategy(MPI.COMM_SELF))
    return _OTHER[0]


def run_in_and_out_of_scope(group, method):
    # _run_in_and_out_of_scope: the method runs in the default state, inside dist.scope(), and
    # under another strategy's scope raises RuntimeError "Mixing different .*Strategy objects"
    dist = group.strategy
    _assert_in_default_state()
    method(dist)
    with dist.scope():
        method(dist)
    _assert_in_default_state()
    with (
        pytest.raises(RuntimeError, match=r"Mixing different .*Strategy objects"),
        another_strategy().scope(),
    ):
        method(dist)
    _assert_in_default_state()


def test_call_for_each_replica(group):
    # testCallForEachReplica: in run_fn a replica context, no cross-replica context, has_strategy,
    # get_strategy() is dist, merge_call returning test_arg "foo"; a variable made there has
    # synchronization AUTO and aggregation NONE; in and out of scope
    dist = group.strategy
    _assert_in_default_state()
    seen = []

    def run_fn():
        replica_context = mpistrat.get_replica_context()
        seen.append(
            (
                replica_context is not None,
                mpistrat.get_cross_replica_context() is None,
                not mpistrat.in_cross_replica_context(),
                mpistrat.has_strategy(),
                mpistrat.get_strategy() is dist,
                replica_context.merge_call(lambda s, test_arg: test_arg, kwargs={"test_arg": "foo"}),
            )
        )

    dist.extended.call_for_each_replica(run_fn)
    with dist.scope():
        dist.extended.call_for_each_replica(run_fn)
    _assert_in_default_state()
    all_ranks_agree(group.comm, seen == [(True, True, True, True, True, "foo")] * 2, f"{seen}")
    with dist.scope():
        v = dist.extended.call_for_each_replica(lambda: mpistrat.Variable(1.0, name="bar"))
    assert v.name == "bar"
    assert v.synchronization == mpistrat.VariableSynchronization.AUTO
    assert v.aggregation == mpistrat.VariableAggregation.NONE


def test_scope(group):
    # testScope: inside scope no replica context, cross-replica context dist, has_strategy; a
    # variable "baz" with AUTO / NONE
    dist = group.strategy
    _assert_in_default_state()
    with dist.scope():
        assert mpistrat.get_replica_context() is None
        assert mpistrat.get_cross_replica_context() is dist
        assert mpistrat.in_cross_replica_context()
        assert mpistrat.has_strategy()
        assert mpistrat.get_strategy() is dist
        v = mpistrat.Variable(1.0, name="baz")
        assert (v.name, v.synchronization, v.aggregation) == (
            "baz",
            mpistrat.VariableSynchronization.AUTO,
            mpistrat.VariableAggregation.NONE,
        )
    _assert_in_default_state()


def test_setting_synchronization_and_aggregation(group):
    # testSettingSynchronizationAndAggregation: ON_WRITE and MEAN are kept
    dist = group.strategy
    with dist.scope():
        v = mpistrat.Variable(
            1.0,
            name="baz",
            synchronization=mpistrat.VariableSynchronization.ON_WRITE,
            aggregation=mpistrat.VariableAggregation.MEAN,
        )
    assert (v.name, v.synchronization, v.aggregation) == (
        "baz",
        mpistrat.VariableSynchronization.ON_WRITE,
        mpistrat.VariableAggregation.MEAN,
    )
    _assert_in_default_state()


def test_set_strategy(group):
    # testSetStrategy: experimental_set_strategy(dist) acts as entering its scope; then dist2; None
    dist, dist2 = group.strategy, another_strategy()
    _assert_in_default_state()
    mpistrat.experimental_set_strategy(dist)
    try:
        assert mpistrat.get_replica_context() is None
        assert mpistrat.get_cross_replica_context() is dist
        assert mpistrat.in_cross_replica_context()
        assert mpistrat.has_strategy()
        assert mpistrat.get_strategy() is dist
        v = mpistrat.Variable(1.0, name="baz")
        assert (v.synchronization, v.aggregation) == (
            mpistrat.VariableSynchronization.AUTO,
            mpistrat.VariableAggregation.NONE,
        )
        mpistrat.experimental_set_strategy(dist2)
        assert mpistrat.get_strategy() is dist2
    finally:
        mpistrat.experimental_set_strategy(None)
    _assert_in_default_state()


def test_set_strategy_in_scope(group):
    # testSetStrategyInScope: RuntimeError "Must not be called inside a `tf.distribute.Strategy`
    # scope" for another strategy, the same one, and None
    dist = group.strategy
    with dist.scope():
        for target in (another_strategy(), dist, None):
            with pytest.raises(RuntimeError, match=r"Must not be called inside a .*Strategy.? scope"):
                mpistrat.experimental_set_strategy(target)
    _assert_in_default_state()


def test_same_scope_nesting(group):
    # testSameScopeNesting: a scope object nests in itself and another of the same strategy, is
    # entered again after it was left; another strategy's scope inside raises RuntimeError
    # "Mixing different tf.distribute.Strategy objects"
    dist = group.strategy
    scope_a = dist.scope()
    with scope_a:
        assert mpistrat.get_strategy() is dist
        scope_b = dist.scope()
        with scope_b:
            assert mpistrat.get_strategy() is dist
            with scope_a:
                assert mpistrat.get_strategy() is dist
            assert mpistrat.get_strategy() is dist
        assert mpistrat.get_strategy() is dist
        scope2 = another_strategy().scope()
        with pytest.raises(RuntimeError, match=r"Mixing different .*Strategy objects"), scope2:
            pass
    _assert_in_default_state()
    with scope_b:
        assert mpistrat.get_strategy() is dist
    _assert_in_default_state()


def test_make_input_fn_iterator(group):
    # testMakeInputFnIterator: make_input_fn_iterator(from_tensors(1.).repeat()) is not None
    def method(dist):
        assert dist.make_input_fn_iterator(lambda ctx: iter(lambda: np.float32(1.0), None)) is not None

    run_in_and_out_of_scope(group, method)


def test_reduce(group):
    # testReduce: reduce(MEAN, 1., axis=None) == 1.
    def method(dist):
        assert float(dist.reduce(ReduceOp.MEAN, np.float32(1.0), axis=None)) == 1.0

    run_in_and_out_of_scope(group, method)


def test_reductions_accept_string_ops(group):
    # testReductions_acceptStringOps: "mean", "MEAN", "sum", "SUM" in reduce, reduce_to and
    # batch_reduce_to; MultiWorkerMirroredStrategy: 1.0 for MEAN, n (1.0 at one worker) for SUM
    dist, n = group.strategy, group.size
    got = []
    for op in ("mean", "MEAN", "sum", "SUM"):
        x, y = np.float32(1.0), np.float32(1.0)
        want = 1.0 if op.lower() == "mean" else float(n)
        x_r = dist.reduce(op, x, axis=None)
        x_t = dist.extended.reduce_to(op, x, "/CPU:0")
        x_b, y_b = dist.extended.batch_reduce_to(op, ((x, "/CPU:0"), (y, "/CPU:0")))
        got.append([float(v) for v in (x_r, x_t, x_b, y_b)] == [want] * 4)
    all_ranks_agree(group.comm, all(got), f"{got}")


def test_reduce_to(group):
    # testReduceTo: reduce_to(MEAN, 1., "/CPU:0") == 1.
    def method(dist):
        assert float(dist.extended.reduce_to(ReduceOp.MEAN, np.float32(1.0), "/CPU:0")) == 1.0

    run_in_and_out_of_scope(group, method)


def test_batch_reduce_to(group):
    # testBatchReduceTo: batch_reduce_to(MEAN, ((1., "/CPU:0"), (1., "/CPU:0"))) == (1., 1.)
    def method(dist):
        x, y = np.float32(1.0), np.float32(1.0)
        x_r, y_r = dist.extended.batch_reduce_to(ReduceOp.MEAN, ((x, "/CPU:0"), (y, "/CPU:0")))
        assert (float(x_r), float(y_r)) == (1.0, 1.0)

    run_in_and_out_of_scope(group, method)


def test_update(group):
    # testUpdate: update(v, assign_fn, (t,)) calls assign_fn(component of v, t): tt is t;
    # MultiWorkerMirroredStrategy hands the replica's component (vv is v._primary, vv is not v)
    with group.strategy.scope():
        v = mpistrat.Variable(1.0)
    t = np.float32(2.0)
    calls = []

    def method(dist):
        def assign_fn(vv, tt):
            calls.append((tt is t, float(vv.read_value()) == 1.0))

        dist.extended.update(v, assign_fn, (t,))

    run_in_and_out_of_scope(group, method)
    assert calls == [(True, True)] * 2


@pytest.mark.parametrize("colocate_with", ["value", "non_slot_devices"])
def test_update_non_slot(group, colocate_with):
    # testUpdateNonSlot: update_non_slot(t, fn), t = constant(2.0), calls fn once, in and out of
    # scope. non_slot_devices(var_list), the tuple MirroredStrategy asserts, works as well
    with group.strategy.scope():
        v = mpistrat.Variable(1.0)

    def method(dist):
        t = np.float32(2.0) if colocate_with == "value" else dist.extended.non_slot_devices([v])
        update_calls = []
        dist.extended.update_non_slot(t, lambda: update_calls.append(1))
        assert len(update_calls) == 1

    run_in_and_out_of_scope(group, method)
    method(mpistrat.get_strategy())  # the default strategy (tf's accepts any colocate_with too)


def test_cluster_resolver_default_not_implemented():
    # testClusterResolverDefaultNotImplemented: a strategy without a cluster has resolver None
    assert mpistrat.get_strategy().cluster_resolver is None


# -- DefaultDistributionStrategyTest ----------------------------------------------------------------


def test_default_merge_call():
    # testMergeCall: in the default strategy's merge_fn: dist is the default strategy, no replica
    # context, cross-replica context dist, in_cross_replica_context, has_strategy() False; "foo_bar"
    _assert_in_default_state()
    seen = []

    def merge_fn(dist, s):
        seen.append(
            (
                dist is ds_context.default_strategy(),
                mpistrat.get_replica_context() is None,
                mpistrat.get_cross_replica_context() is dist,
                mpistrat.in_cross_replica_context(),
                mpistrat.get_strategy() is dist,
                mpistrat.has_strategy(),
            )
        )
        return "foo_" + s

    replica_ctx = mpistrat.get_replica_context()
    assert replica_ctx is ds_context.default_strategy().extended.default_replica_context
    assert replica_ctx.merge_call(merge_fn, args=("bar",)) == "foo_bar"
    assert seen == [(True, True, True, True, True, False)]
    _assert_in_default_state()


def test_scope_mostly_no_op():
    # testScopeMostlyNoOp: the default strategy's scope keeps the default state; another strategy's
    # scope inside it, creating a variable, raises RuntimeError "Mixing different
    # tf.distribute.Strategy objects"
    _assert_in_default_state()
    test_strategy = another_strategy()
    with test_strategy.scope():
        mpistrat.Variable(1.0, name="before")
    scope = ds_context.default_strategy().scope()
    with scope:
        _assert_in_default_state()
        with test_strategy.scope(), pytest.raises(RuntimeError, match=r"Mixing different .*Strategy objects"):
            mpistrat.Variable(1.0, name="error")
        with scope:
            _assert_in_default_state()
            with (
                test_strategy.scope(),
                pytest.raises(RuntimeError, match=r"Mixing different .*Strategy objects"),
            ):
                mpistrat.Variable(1.0, name="also_error")
        _assert_in_default_state()
    _assert_in_default_state()
    with test_strategy.scope():
        mpistrat.Variable(1.0, name="after")


def test_default_run():
    # testExperimentalRunV2: the default strategy runs train_step on range(10).batch(2)'s first
    # element twice
    default_strategy = ds_context.default_strategy()
    next_val = next(
        iter(default_strategy.experimental_distribute_dataset([np.arange(0, 2), np.arange(2, 4)]))
    )
    for _ in range(2):
        assert default_strategy.run(lambda input_data: input_data, args=(next_val,)).tolist() == [0, 1]


def test_default_distributed_datasets():
    # testDistributedDatasets: next(iter(experimental_distribute_dataset(range(10).batch(2)))) == [0, 1]
    default_strategy = ds_context.default_strategy()
    batches = [np.arange(i, i + 2) for i in range(0, 10, 2)]
    dist_dataset = default_strategy.experimental_distribute_dataset(batches)
    assert next(iter(dist_dataset)).tolist() == [0, 1]


def test_default_distributed_datasets_from_function():
    # testDistributedDatasetsFromFunction: the same through experimental_distribute_datasets_from_function
    default_strategy = ds_context.default_strategy()
    dist = default_strategy.experimental_distribute_datasets_from_function(
        lambda _: [np.arange(i, i + 2) for i in range(0, 10, 2)]
    )
    assert next(iter(dist)).tolist() == [0, 1]


def test_v2():
    # testV2: get_strategy() is a Strategy
    assert isinstance(mpistrat.get_strategy(), mpistrat.Strategy)


# -- InputContextTest -------------------------------------------------------------------------------


def test_input_context_properties():
    # testProperties: (2, 1, 6)
    ctx = mpistrat.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6)
    assert (ctx.num_replicas_in_sync, ctx.input_pipeline_id, ctx.num_input_pipelines) == (6, 1, 2)


def test_input_context_per_replica_batch_size():
    # testPerReplicaBatchSize: 12 -> 2; 13 raises ValueError
    ctx = mpistrat.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6)
    assert ctx.get_per_replica_batch_size(12) == 2
    with pytest.raises(ValueError):
        ctx.get_per_replica_batch_size(13)
    assert issubclass(InvalidArgumentError, ValueError)


def test_input_context_str():
    # testStr: "tf.distribute.InputContext(input pipeline id 0, total: 1)" and "(... id 1, total: 3)";
    # the same with this package's name for tf.distribute
    assert str(mpistrat.InputContext(1, 0, 42)) == "mpistrat.InputContext(input pipeline id 0, total: 1)"
    assert str(mpistrat.InputContext(3, 1, 42)) == "mpistrat.InputContext(input pipeline id 1, total: 3)"


def test_context_error_is_a_runtime_error():
    # the RuntimeError every "Mixing different ... Strategy objects" case above expects
    assert issubclass(ContextError, RuntimeError)
