"""TensorFlow's ``cross_device_ops_test.py``: ``_testReductionAndBroadcast``, through the strategy.

Ported from tensorflow/python/distribute/cross_device_ops_test.py (TF 2.21). TF checks each
``CrossDeviceOps`` implementation (``ReductionToOneDevice``, ``AllReduceCrossDeviceOps``,
``CollectiveAllReduce`` between workers) on per-replica values where replica ``r`` holds
``float(r)`` (and ``r + 1.``): ``reduce`` and ``batch_reduce`` with MEAN give ``(n - 1) / 2``
(``+ 1``) and with SUM ``n`` times that, for every kind of destination (a mirrored value on the
replicas' devices, a mirrored value on the CPU, a device string); ``broadcast(1.)`` gives 1.
mpistrat has one implementation (MPI), reached through ``StrategyExtended.reduce_to``,
``batch_reduce_to`` and ``broadcast_to``, in cross-replica context (each rank's value) and inside
``merge_fn`` (the ``PerReplica``, in both merge modes).

The collective section (``CollectiveAllReduceTest._test_reduction``, ``testReductionDistributed``
with ``bytes_per_pack`` 0, 1, 4 and the strategy object) runs on ``NUM_WORKERS = 3`` workers of
one CPU device each: every worker's value is ``[0.]`` (its one device's index) and ``[1.]``, so
MEAN gives ``[0.]`` and ``[1.]`` and SUM ``[0.]`` and ``[num_workers]`` (``[3.]``); here the
workers are the ranks. ``testReduceDistributedVariable``: MEAN of a mirrored ``Variable(1.)``.

Not ported: the ``IndexedSlices`` cases (no sparse values here), ``testChooseAlgorithm`` and the
NCCL / hierarchical-copy / GPU-only combinations (one implementation here), the collective-key
and timeout cases that drive TF's collective ops directly.
"""

import itertools

import numpy as np
import pytest

import mpistrat
from mpistrat import ReduceOp
from tests.conftest import RankChecks, all_ranks_agree, strategy_in_mode

DESTINATIONS = ["mirrored_variable", "mirrored_cpu", "device_string"]
_STRATEGIES: dict = {}  # per communicator and bytes_per_pack


def _destination(s, kind):
    if kind == "mirrored_variable":
        with s.scope():
            return mpistrat.Variable(np.float32(1.0))
    if kind == "mirrored_cpu":
        return "/job:worker/replica:0/task:0/device:CPU:0"
    return "/device:CPU:0"


def _expected(n):
    mean = (n - 1.0) / 2.0
    return {("MEAN", 1): mean, ("MEAN", 2): mean + 1.0, ("SUM", 1): mean * n, ("SUM", 2): (mean + 1.0) * n}


@pytest.mark.parametrize("destination", DESTINATIONS)
def test_reduce(group, destination):
    # _testReductionAndBroadcast, reduce(): MEAN of per_replica == (n - 1) / 2 (0.5), of
    # per_replica_2 == that + 1 (1.5); SUM == n times each (1.0, 3.0), float32
    s, n, r = group.strategy, group.size, group.rank
    dest = _destination(s, destination)
    want = _expected(n)
    got = {}
    with s.scope():
        for op, which in itertools.product(("MEAN", "SUM"), (1, 2)):
            value = np.float32(r if which == 1 else r + 1.0)
            got[(op, which)] = s.extended.reduce_to(ReduceOp(op), value, destinations=dest)
    ok = all(float(got[k]) == want[k] and np.asarray(got[k]).dtype == np.float32 for k in want)
    all_ranks_agree(group.comm, ok, f"{got} != {want}")


@pytest.mark.parametrize("d1,d2", list(itertools.product(DESTINATIONS, DESTINATIONS)))
def test_batch_reduce(group, d1, d2):
    # batch_reduce(op, [(per_replica, d1), (per_replica_2, d2)]) == [expected 1, expected 2]
    s, n, r = group.strategy, group.size, group.rank
    a, b = _destination(s, d1), _destination(s, d2)
    want = _expected(n)
    checks = RankChecks()
    with s.scope():
        for op in ("MEAN", "SUM"):
            x, y = s.extended.batch_reduce_to(ReduceOp(op), [(np.float32(r), a), (np.float32(r + 1.0), b)])
            checks.that((float(x), float(y)) == (want[(op, 1)], want[(op, 2)]))
    checks.agree(group.comm)


@pytest.mark.parametrize("destination", DESTINATIONS)
def test_broadcast(group, destination):
    # broadcast(constant(1.), destinations) == mirrored 1.
    s = group.strategy
    dest = _destination(s, destination)
    with s.scope():
        got = s.extended.broadcast_to(np.float32(1.0), dest)
    values = s.experimental_local_results(got)
    all_ranks_agree(group.comm, all(float(v) == 1.0 for v in values), f"{got}")


@pytest.mark.parametrize("mode", ["root", "every_rank"])
def test_reduce_and_batch_reduce_inside_merge_fn(group, mode):
    # the same values reduced from the PerReplica that merge_fn receives (TF's cross-device ops
    # receive exactly such a PerReplica): MEAN (n - 1) / 2 and + 1, SUM n times those
    s, n = strategy_in_mode(group, mode), group.size
    want = _expected(n)

    def merge_fn(strategy, p1, p2):
        ext = strategy.extended
        out = [ext.reduce_to(ReduceOp(op), p, "/device:CPU:0") for op in ("MEAN", "SUM") for p in (p1, p2)]
        out += list(ext.batch_reduce_to(ReduceOp.SUM, [(p1, "/device:CPU:0"), (p2, "/device:CPU:0")]))
        return [float(strategy.experimental_local_results(v)[0]) for v in out]

    got = s.run(
        lambda: mpistrat.get_replica_context().merge_call(
            merge_fn, args=(np.float32(group.rank), np.float32(group.rank + 1.0))
        )
    )
    expect = [want[("MEAN", 1)], want[("MEAN", 2)], want[("SUM", 1)], want[("SUM", 2)]]
    expect += [want[("SUM", 1)], want[("SUM", 2)]]
    all_ranks_agree(group.comm, got == expect, f"{got} != {expect}")


# -- CollectiveAllReduceTest ------------------------------------------------------------------------


@pytest.mark.parametrize("bytes_per_pack", [0, 1, 4])
def test_reduction_distributed(group, bytes_per_pack):
    # testReductionDistributed (use_strategy_object=True, required_gpus=0): 1-d values, each worker
    # [0.] and [1.]; for every destination MEAN [0.], [1.]; SUM [0.], [num_workers] ([3.] at 3);
    # batch_reduce the same pairwise
    checks = RankChecks()
    n = group.size
    options = mpistrat.CommunicationOptions(bytes_per_pack=bytes_per_pack)
    key = (group.name, "bytes_per_pack", bytes_per_pack)
    if key not in _STRATEGIES:
        _STRATEGIES[key] = mpistrat.MPIStrategy(group.comm, communication_options=options)
    s = _STRATEGIES[key]
    one, two = np.array([0.0], np.float32), np.array([1.0], np.float32)
    want = {"MEAN": ([0.0], [1.0]), "SUM": ([0.0], [1.0 * n])}
    got = []
    with s.scope():
        for destination in DESTINATIONS:
            dest = _destination(s, destination)
            for op in ("MEAN", "SUM"):
                pair = [np.asarray(s.extended.reduce_to(ReduceOp(op), v, dest)).tolist() for v in (one, two)]
                got.append(pair)
                checks.that(tuple(pair) == want[op])
        for d1, d2 in itertools.product(DESTINATIONS, DESTINATIONS):
            a, b = _destination(s, d1), _destination(s, d2)
            for op in ("MEAN", "SUM"):
                x, y = s.extended.batch_reduce_to(ReduceOp(op), [(one, a), (two, b)])
                checks.that((np.asarray(x).tolist(), np.asarray(y).tolist()) == want[op])
    checks.agree(group.comm, f"{got}")


@pytest.mark.parametrize("batch_reduce", [False, True])
def test_reduce_distributed_variable(group, batch_reduce):
    # testReduceDistributedVariable: MEAN of a mirrored Variable(1.) to itself: 1.0 on every replica
    s = group.strategy
    with s.scope():
        v = mpistrat.Variable(np.float32(1.0))
        if batch_reduce:
            result = s.extended.batch_reduce_to(ReduceOp.MEAN, [(v, v)])[0]
        else:
            result = s.extended.reduce_to(ReduceOp.MEAN, v, v)
    values = [float(x) for x in s.experimental_local_results(result)]
    all_ranks_agree(group.comm, values == [1.0] * len(values) and values, f"{values}")
