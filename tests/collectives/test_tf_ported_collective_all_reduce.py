"""TensorFlow's ``collective_all_reduce_strategy_test.py``, the cases a multi-worker strategy runs.

Ported from tensorflow/python/distribute/collective_all_reduce_strategy_test.py (TF 2.21) and the
``strategy_test_lib`` helpers it calls. TF runs them between graph clients of a 3-worker cluster
(``DistributedCollectiveAllReduceStrategyTest``), or on one worker with 2 GPUs
(``LocalCollectiveAllReduceStrategy``, whose replica ``i`` is rank ``i`` here, reading element
``i`` of the dataset). Expected values are TF's, written as formulas of ``n`` replicas.

Not ported: ``test_prefetch_to_device_dataset``/``test_prefetch_to_host_dataset`` (graph-mode V1
datasets, device placement), ``testEnableCollectiveOps`` (mocks TF's context), the gradient
variants of ``testAllReduce*`` (no autodiff), ``testMinimizeLoss`` on 2/4 GPUs (eager, the same
loop as ``testMinimizeLossGraph`` below) and ``LogicalDeviceTest`` (GPU logical devices).
``extended.read_var(v)`` (V1) is ported as ``v.read_value()``.
"""

import numpy as np
import pytest

import mpistrat
from mpistrat import ReduceOp
from tests.conftest import RankChecks, all_ranks_agree


def test_num_replicas_in_sync(group):
    # test_num_replicas_in_sync: num_gpus * num_workers; one replica per worker (rank) here: n
    all_ranks_agree(group.comm, group.strategy.num_replicas_in_sync == group.size)


def test_minimize_loss(group):
    # testMinimizeLossGraph: kernel (1, 1) from GlorotUniform, loss (x @ kernel - 1)^2 with x = [[1.]];
    # each step reduce_to(SUM, grad, destinations=kernel), then update(kernel, assign_sub(0.05 g,
    # use_locking=True)); after 10 steps |kernel - 1| is smaller than before the first.
    s = group.strategy
    rng = np.random.default_rng(group.comm.Get_rank())  # each rank draws its own; rank 0's is kept
    limit = np.sqrt(6.0 / 2)  # Glorot uniform for fan_in = fan_out = 1
    with s.scope():
        kernel = mpistrat.Variable(rng.uniform(-limit, limit, (1, 1)).astype(np.float32), trainable=True)
    one = np.array([[1.0]], np.float32)

    def grad_fn(x):
        y = (x @ kernel.read_value()).reshape(()) - np.float32(1.0)
        return 2 * y * x.T  # d(y^2)/d kernel

    def update(v, g):
        return v.assign_sub(0.05 * g, use_locking=True)

    before = after = None
    for i in range(10):
        g = s.extended.call_for_each_replica(grad_fn, args=[one])
        fetched = kernel.read_value().copy()
        with s.scope():
            g = s.extended.reduce_to(ReduceOp.SUM, g, destinations=kernel)
            s.extended.update(kernel, update, args=(g,), group=False)
        if i == 0:
            before = fetched
        after = kernel.read_value().copy()
    error_before, error_after = abs(before.item() - 1), abs(after.item() - 1)
    all_ranks_agree(group.comm, error_after < error_before, f"{error_before} -> {error_after}")


def test_variable_initialization(group):
    # testVariableInitialization: x = variable (2, 3) from random_uniform(1, 10) created in scope;
    # x_value == reduce(MEAN, identity(x)) (atol 1e-5): every replica holds the same initial value
    s = group.strategy
    rng = np.random.default_rng(100 + group.rank)  # a different draw on every rank
    with s.scope():
        x = mpistrat.Variable(rng.uniform(1.0, 10.0, (2, 3)).astype(np.float32))
        per_replica = s.extended.call_for_each_replica(lambda: np.array(x.read_value()))
        reduced = s.reduce(ReduceOp.MEAN, per_replica, axis=None)
    local = s.experimental_local_results(per_replica)[0]
    all_ranks_agree(group.comm, np.allclose(local, reduced, atol=1e-5), f"{local} {reduced}")


def _input_fn_checking_context(n, rank, fn):
    seen = []

    def input_fn(ctx):
        # _input_fn_to_test_input_context: num_replicas_in_sync == n, num_input_pipelines == n
        # (3 workers, one pipeline each), input_pipeline_id == task_id
        seen.append((ctx.num_replicas_in_sync, ctx.num_input_pipelines, ctx.input_pipeline_id))
        return fn()

    return input_fn, seen


@pytest.mark.parametrize("use_dataset", [True, False])
def test_make_input_fn_iterator(group, use_dataset):
    # testMakeInputFnIterator (required_gpus=0: one CPU replica per worker): input_fn gives
    # range(20) on every worker; expected values [[0], [1], ..., [19]], then OutOfRangeError
    # (StopIteration here), and after iterator.initialize() the same again (use_dataset only).
    # use_dataset=False is an iterator's get_next function in TF: a one-shot generator here.
    s, n, r = group.strategy, group.size, group.rank
    fn = (lambda: range(20)) if use_dataset else (lambda: iter(range(20)))
    input_fn, seen = _input_fn_checking_context(n, r, fn)
    iterator = s.make_input_fn_iterator(input_fn)
    iterator.initialize()
    got = [[int(v) for v in s.experimental_local_results(iterator.get_next())] for _ in range(20)]
    try:
        iterator.get_next()
        ended = False
    except StopIteration:
        ended = True
    checks = RankChecks()
    checks.that(got == [[i] for i in range(20)] and ended and seen == [(n, n, r)])
    if use_dataset:
        iterator.initialize()
        again = [[int(v) for v in s.experimental_local_results(iterator.get_next())] for _ in range(20)]
        checks.that(again == got)
    checks.agree(group.comm, f"{got} {ended} {seen}")


def test_update_config_proto(group):
    # testUpdateConfigProto (task 1 of the workers): collective_group_leader
    # '/job:worker/replica:0/task:0'; device_filters ['/job:worker/task:1']: the task is the rank.
    # (ConfigProto is a dict here; the scoped-allocator rewrite options are not ported.)
    s = group.strategy
    config = {"device_filters": ["to_be_overridden"]}
    new = s.update_config_proto(config)
    ok = (
        new["experimental"]["collective_group_leader"] == "/job:worker/replica:0/task:0"
        and new["device_filters"] == [f"/job:worker/task:{group.rank}"]
        and config == {"device_filters": ["to_be_overridden"]}
    )
    all_ranks_agree(group.comm, ok, f"{new}")


def test_enable_collective_ops_and_cluster_resolver(group):
    # testEnableCollectiveOpsAndClusterResolver (task 1): cluster_resolver.task_type == 'worker',
    # task_id == 1: the rank
    resolver = group.strategy.cluster_resolver
    all_ranks_agree(group.comm, (resolver.task_type, resolver.task_id) == ("worker", group.rank))


# LocalCollectiveAllReduceStrategy: replica i reads element i of from_tensor_slices(inputs).
SUM_INPUTS = ([1.0, 3.0], [[39.0, 2.0], [3.0, 41.0]])  # expected all_sum: (4., [42., 43.]) at 2


def _collective_comms(group, op):
    # _test_collective_comms: make_input_fn_iterator(from_tensor_slices(inputs)), experimental_run
    # of all_reduce(op, element); every local result is `expected`. Replica r reads element
    # r % 2 (TF has 2 replicas: elements 0 and 1).
    s, n = group.strategy, group.size

    def input_fn(ctx):
        i = ctx.input_pipeline_id % 2
        return [(np.float32(SUM_INPUTS[0][i]), np.array(SUM_INPUTS[1][i], np.float32))]

    inputs = s.make_input_fn_iterator(input_fn)
    inputs.initialize()
    outputs = s.experimental_run(lambda v: mpistrat.get_replica_context().all_reduce(op, v), inputs)
    scalars = [SUM_INPUTS[0][r % 2] for r in range(n)]
    vectors = [SUM_INPUTS[1][r % 2] for r in range(n)]
    total = (sum(scalars), np.sum(vectors, axis=0).tolist())
    return outputs, total


def test_all_reduce_sum(group):
    # testAllReduceSum: expected (4., [42., 43.]) at 2 replicas
    (scalar, vector), (want_s, want_v) = _collective_comms(group, ReduceOp.SUM)
    checks = RankChecks()
    checks.that(float(scalar) == want_s and vector.tolist() == want_v and vector.dtype == np.float32)
    if group.size == 2:
        checks.that((want_s, want_v) == (4.0, [42.0, 43.0]))
    checks.agree(group.comm, f"{scalar} {vector}")


def test_all_reduce_mean(group):
    # testAllReduceMean: expected (2., [21., 21.5]) at 2 replicas
    n = group.size
    (scalar, vector), (want_s, want_v) = _collective_comms(group, ReduceOp.MEAN)
    checks = RankChecks()
    checks.that(np.isclose(float(scalar), want_s / n) and np.allclose(vector, np.array(want_v) / n))
    if n == 2:
        checks.that(float(scalar) == 2.0 and vector.tolist() == [21.0, 21.5])
    checks.agree(group.comm, f"{scalar} {vector}")


def test_numpy_dataset(group):
    # testNumpyDataset (_test_numpy_dataset): x (6, 2), y (6,), global batch 6 over 2 epochs through
    # make_dataset_iterator; each step's local results concatenated over replicas == (x, y), twice,
    # then OutOfRangeError (StopIteration here). The replicas' parts are gathered to compare.
    s = group.strategy
    x = np.asarray([[1, 2], [6, 12], [2, 4], [5, 10], [3, 6], [4, 8]])
    y = np.asarray([5, 4, 3, 2, 1, 0])
    with s.scope():
        it = s.make_dataset_iterator([(x, y), (x, y)])  # ds.repeat(2).batch(6)
        it.initialize()
        checks = RankChecks()
        for _ in range(2):
            bx, by = s.experimental_run(lambda z: z, it)
            checks.that(np.array_equal(s.gather(bx, axis=0), x) and np.array_equal(s.gather(by, axis=0), y))
        try:
            s.experimental_run(lambda z: z, it)
            ended = False
        except StopIteration:
            ended = True
    checks.that(ended)
    checks.agree(group.comm)
