"""TensorFlow's ``strategy_common_test.py``, the cases that apply to a multi-worker strategy.

Ported from tensorflow/python/distribute/strategy_common_test.py (TF 2.21), where they run on
``multi_worker_mirrored_2x1_cpu``: 2 workers of one replica each, as 2 ranks are here. Each
expected value is TF's, written as a formula of the number of replicas ``n`` with TF's value
at ``n = 2`` in the comment; worker ``i`` of TF's cluster (``chief`` is 0) is rank ``i``.
``tf.function`` variants are the eager case once: there is no graph mode here.

Not ported (no counterpart here): ``testNestedInput`` (skipped in TF itself), TPU-only cases.
``extended._replica_ctx_all_reduce`` (private) is ported as ``ReplicaContext.all_reduce``.
"""

import numpy as np
import pytest

import mpistrat
from mpistrat import InvalidArgumentError, ReduceOp
from tests.conftest import all_ranks_agree, raises_on_every_rank, strategy_in_mode

# -- StrategyTest ---------------------------------------------------------------------------------


def test_capture_replica_id(group):
    # testCaptureReplicaId: strategy.run(f) where f returns replica_id_in_sync_group; replica r: r
    s = group.strategy
    got = s.run(lambda: mpistrat.get_replica_context().replica_id_in_sync_group)
    all_ranks_agree(group.comm, got == group.rank, f"{got}")


# -- ReduceTest -----------------------------------------------------------------------------------


def test_reduce_basic(group):
    # testBasic: values_from_function(ones((), float32)); reduce(SUM, axis=None) == 1.0 * n (2.0),
    # inside strategy.scope() and outside it
    s, n = group.strategy, group.size
    per_replica = s.experimental_distribute_values_from_function(lambda _: np.ones((), np.float32))
    with s.scope():
        inside = s.reduce(ReduceOp.SUM, value=per_replica, axis=None)
    outside = s.reduce(ReduceOp.SUM, value=per_replica, axis=None)
    ok = float(inside) == float(outside) == 1.0 * n and np.asarray(inside).dtype == np.float32
    all_ranks_agree(group.comm, ok, f"{inside!r} {outside!r}")


def test_reduce_axis(group):
    # testAxis: x = run(lambda: [1., 2.]); reduce(MEAN, x, axis=0) == 1.5; reduce(SUM, ..) == 3 n (6.0)
    s, n = group.strategy, group.size
    x = s.run(lambda: np.array([1.0, 2.0], np.float32))
    mean = s.reduce(ReduceOp.MEAN, x, axis=0)
    total = s.reduce(ReduceOp.SUM, x, axis=0)
    all_ranks_agree(group.comm, float(mean) == 1.5 and float(total) == 3.0 * n, f"{mean} {total}")


# -- ReplicaCtxAllReduceTest ----------------------------------------------------------------------


def test_replica_ctx_all_reduce_basic(group):
    # testBasic: in replica_fn, all_reduce('SUM', identity(1.0)); local results[0] == 1.0 * n (2.0)
    s, n = group.strategy, group.size

    def replica_fn():
        return mpistrat.get_replica_context().all_reduce("SUM", np.float32(1.0))

    got = s.experimental_local_results(s.run(replica_fn))[0]
    all_ranks_agree(group.comm, float(got) == 1.0 * n, f"{got}")


# -- ReplicaCtxUpdateTest ------------------------------------------------------------------------


@pytest.mark.parametrize("update_fn", ["assign", "assign_add", "assign_sub"])
@pytest.mark.parametrize("api", ["replica_context", "extended"])
def test_replica_ctx_update_dense(group, update_fn, api):
    # testDenseUpdate: a variable at 5.0; in replica_fn, replica_context._update(v, fn, args=(2.0,)),
    # then again with the Python literal 1.0: every local result 1.0 (assign), 8.0 (assign_add),
    # 2.0 (assign_sub). strategy.extended.update called in replica context is the same path (the one
    # Keras optimizers take without merge_call)
    s = group.strategy
    with s.scope():
        v = mpistrat.Variable(np.float32(5.0))

    def replica_fn():
        ctx = mpistrat.get_replica_context()
        update = ctx._update if api == "replica_context" else s.extended.update
        fn = {
            "assign": lambda var, value: var.assign(value),
            "assign_add": lambda var, value: var.assign_add(value),
            "assign_sub": lambda var, value: var.assign_sub(value),
        }[update_fn]
        update(v, fn, args=(np.float32(2.0),))
        update(v, fn, args=(1.0,))

    s.run(replica_fn)
    got = [np.asarray(x).item() for x in s.experimental_local_results(v)]
    want = {"assign": 1.0, "assign_add": 8.0, "assign_sub": 2.0}[update_fn]
    all_ranks_agree(group.comm, got == [want] and v.dtype == np.float32, f"{got} {v.dtype}")


@pytest.mark.parametrize("where", ["replica", "cross_replica", "every_rank_merge_fn"])
def test_update_takes_each_replicas_own_value(group, where):
    # tf 2.21 (MirroredStrategy, n replicas): extended.update(v, assign, args=(PerReplica(10 + i),))
    # writes copy i of a sync-on-read SUM variable its own value, 10 + i, called in replica context
    # or with a PerReplica built in cross-replica context; a merge_fn that passes its merged
    # arguments to update (tf's own replica-context update through merge_call) does the same
    n, r = group.size, group.rank
    strategy = strategy_in_mode(group, "every_rank" if where == "every_rank_merge_fn" else "root")
    with strategy.scope():
        v = mpistrat.Variable(np.float32(5.0), synchronization="ON_READ", aggregation="SUM")
    values = mpistrat.PerReplica(tuple(np.float32(10 + i) for i in range(n)))
    assign = lambda var, x: var.assign(x)  # noqa: E731
    if where == "replica":
        strategy.run(lambda: strategy.extended.update(v, assign, args=(values,)))
    elif where == "cross_replica":
        with strategy.scope():
            strategy.extended.update(v, assign, args=(values,))
    else:
        merge_fn = lambda st, x: st.extended.update(v, assign, args=(x,))  # noqa: E731
        strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn, args=(np.float32(10 + r),)))
    mine = strategy.run(lambda: float(v.read_value()))
    with strategy.scope():
        total = float(v.read_value())
    ok = mine == 10.0 + r and total == sum(10.0 + i for i in range(n))
    all_ranks_agree(group.comm, ok, f"{mine} {total}")


def test_update_of_a_mirrored_variable_with_values_that_differ(group):
    # tf 2.21 writes copy i of a mirrored variable 10 + i as well, and its copies drift apart (its
    # ReplicaContext._update docstring: "dangerously out of synchronization"). Each rank here reads
    # its own copy, so they raise instead: CollectiveMismatchError naming the ranks, nothing written.
    # Equal values are written (10.0 everywhere)
    s, n = group.strategy, group.size
    with s.scope():
        v = mpistrat.Variable(np.float32(5.0))
    assign = lambda var, x: var.assign(x)  # noqa: E731
    if n > 1:
        differ = mpistrat.PerReplica(tuple(np.float32(10 + i) for i in range(n)))
        raises_on_every_rank(
            group.comm,
            mpistrat.CollectiveMismatchError,
            lambda: s.run(lambda: s.extended.update(v, assign, args=(differ,))),
            "rank 1",
        )
    same = mpistrat.PerReplica(tuple(np.float32(10) for _ in range(n)))
    s.run(lambda: s.extended.update(v, assign, args=(same,)))
    got = [np.asarray(x).item() for x in s.experimental_local_results(v)]
    all_ranks_agree(group.comm, got == [10.0], f"{got}")


# -- DistributedCollectiveAllReduceStrategyTest -------------------------------------------------------


def _shard(batches, n, i):
    return batches[i::n]


def test_dataset_from_function(group):
    # testDatasetFromFunction: per-replica batch 10 // n of range(100).repeat(), sharded by worker;
    # the sum of the first batch: chief 10 (0..4), worker 35 (5..9). With 10 % n != 0,
    # get_per_replica_batch_size raises ValueError (tf's message: "... is not divisible by ...").
    s, n, r = group.strategy, group.size, group.rank

    def dataset_fn(ctx):
        b = ctx.get_per_replica_batch_size(10)
        data = np.arange(100 * 3) % 100  # range(100).repeat(), enough of it
        batches = [data[k : k + b] for k in range(0, len(data) - b + 1, b)]
        return _shard(batches, ctx.num_input_pipelines, ctx.input_pipeline_id)

    if 10 % n:
        raises_on_every_rank(
            group.comm,
            InvalidArgumentError,
            lambda: s.distribute_datasets_from_function(dataset_fn),
            "divisible",
        )
        return
    it = iter(s.distribute_datasets_from_function(dataset_fn))
    got = int(np.sum(s.experimental_local_results(it.get_next())))
    b = 10 // n
    want = sum(range(r * b, (r + 1) * b))  # n = 2: rank 0 10, rank 1 35
    all_ranks_agree(group.comm, got == want, f"{got} != {want}")


def test_simple_input_from_dataset_last_partial_batch(group):
    # testSimpleInputFromDatasetLastPartialBatch: range(14).batch(8); the second (partial) batch
    # [8..13] is split: chief [8, 9, 10], worker [11, 12, 13] (ceil(6 / n) each, in worker order)
    s, n, r = group.strategy, group.size, group.rank
    dataset = [np.arange(0, 8), np.arange(8, 14)]
    it = iter(s.experimental_distribute_dataset(dataset))
    s.run(lambda x: x, args=(next(it),))
    result = s.run(lambda x: x, args=(next(it),))
    per = -(-6 // n)
    want = list(range(8, 14))[r * per : (r + 1) * per]
    all_ranks_agree(group.comm, np.asarray(result).tolist() == want, f"{result} != {want}")


def test_simple_input_from_fn_last_partial_batch(group):
    # testSimpleInputFromFnLastPartialBatch: range(14).batch(8 // n).shard(n, i); the second step:
    # chief [8, 9, 10, 11], worker [12, 13]; 8 % n != 0 raises in get_per_replica_batch_size
    s, n, r = group.strategy, group.size, group.rank

    def dataset_fn(ctx):
        b = ctx.get_per_replica_batch_size(8)
        batches = [np.arange(k, min(k + b, 14)) for k in range(0, 14, b)]
        return _shard(batches, ctx.num_input_pipelines, ctx.input_pipeline_id)

    if 8 % n:
        raises_on_every_rank(
            group.comm,
            InvalidArgumentError,
            lambda: s.distribute_datasets_from_function(dataset_fn),
            "divisible",
        )
        return
    it = iter(s.distribute_datasets_from_function(dataset_fn))
    s.run(lambda x: x, args=(next(it),))
    result = s.run(lambda x: x, args=(next(it),))
    b = 8 // n
    start = (n + r) * b
    want = list(range(start, min(start + b, 14)))
    all_ranks_agree(group.comm, np.asarray(result).tolist() == want, f"{result} != {want}")


def test_reduce_host_tensor(group):
    # testReduceHostTensor: reduce(SUM, identity(1.), axis=None) == 2.0 at 2 workers (each worker's
    # own value counts): n
    s, n = group.strategy, group.size
    got = s.reduce(ReduceOp.SUM, np.float32(1.0), axis=None)
    all_ranks_agree(group.comm, float(got) == n, f"{got}")


def test_reduce_to_host_tensor(group):
    # testReduceToHostTensor: extended.reduce_to(SUM, value, value) == 2.0: n
    s, n = group.strategy, group.size
    value = np.float32(1.0)
    got = s.extended.reduce_to(ReduceOp.SUM, value, value)
    all_ranks_agree(group.comm, float(got) == n, f"{got}")


def test_batch_reduce_to_host_tensor(group):
    # testBatchReduceToHostTensor: batch_reduce_to(SUM, [(v, v), (v, v)]) == [2., 2.]: [n, n]
    s, n = group.strategy, group.size
    value = np.float32(1.0)
    got = s.extended.batch_reduce_to(ReduceOp.SUM, [(value, value), (value, value)])
    all_ranks_agree(group.comm, [float(g) for g in got] == [n, n], f"{got}")


def test_reduce_device_tensors(group):
    # testReduceDeviceTensors: value = run(lambda: identity(1.)); reduce(SUM) == 2.0: n
    s, n = group.strategy, group.size
    value = s.run(lambda: np.float32(1.0))
    got = s.reduce(ReduceOp.SUM, value, axis=None)
    all_ranks_agree(group.comm, float(got) == n, f"{got}")


def test_reduce_to_device_tensors(group):
    # testReduceToDeviceTensors: reduce_to(SUM, value, value) == 2.0: n
    s, n = group.strategy, group.size
    value = s.run(lambda: np.float32(1.0))
    got = s.extended.reduce_to(ReduceOp.SUM, value, value)
    all_ranks_agree(group.comm, float(got) == n, f"{got}")


def test_batch_reduce_to_device_tensors(group):
    # testBatchReduceToDeviceTensors: [2., 2.]: [n, n]
    s, n = group.strategy, group.size
    value = s.run(lambda: np.float32(1.0))
    got = s.extended.batch_reduce_to(ReduceOp.SUM, [(value, value), (value, value)])
    all_ranks_agree(group.comm, [float(g) for g in got] == [n, n], f"{got}")


_MWMS: list = []


def multi_worker():
    """One MultiWorkerMirroredStrategy for the module (creating one is collective over the world)."""
    if not _MWMS:
        _MWMS.append(mpistrat.MultiWorkerMirroredStrategy())
    return _MWMS[0]


# -- StrategyClusterResolverTest ------------------------------------------------------------------


@pytest.mark.parametrize("which", ["mpi", "multi_worker", "default"])
def test_cluster_resolver_property(group, which):
    # testClusterResolverProperty: a collective strategy's resolver has cluster_spec, master,
    # num_accelerators, task_id and task_type, is the same object inside scope(), and its
    # task_type is 'chief' or 'worker'; other strategies' (the default one) is None.
    # TF's task_id is 0 on both workers (chief:0 and worker:0); here it is the rank
    # (a row of docs/migrating.md's differences: "strategy.cluster_resolver of an MPI strategy").
    if which == "default":
        assert mpistrat.get_strategy().cluster_resolver is None
        return
    s = group.strategy if which == "mpi" else multi_worker()
    comm = group.comm if which == "mpi" else mpistrat.MPI.COMM_WORLD
    resolver = s.cluster_resolver
    with s.scope():
        same = s.cluster_resolver is resolver
    attrs = all(
        hasattr(resolver, a) for a in ("cluster_spec", "master", "num_accelerators", "task_id", "task_type")
    )
    ok = same and attrs and resolver.task_type in ("chief", "worker") and resolver.task_id == comm.Get_rank()
    all_ranks_agree(comm, ok, f"{resolver.task_type} {resolver.task_id}")
