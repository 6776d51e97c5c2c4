"""What multi-worker tf.distribute code reaches for, against TensorFlow 2.21's answers.

Every expected value was printed by ``tensorflow-cpu`` 2.21 (``MirroredStrategy`` on 2
logical CPUs, or ``MultiWorkerMirroredStrategy`` on one worker) and is written here as a
formula of the number of replicas ``n``, with tf's value at 2 replicas in the comment.
Replica ``r`` is rank ``r``.
"""

import copy
import os
import signal

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat
from mpistrat import CommunicationOptions, ContextError, InvalidArgumentError
from tests.conftest import RankChecks, all_ranks_agree, in_merge_fn, raises_on_every_rank, strategy_in_mode

OPTIONS = [
    None,
    CommunicationOptions(bytes_per_pack=8, timeout_seconds=30.0),
    mpistrat.experimental.CommunicationOptions(
        implementation=mpistrat.experimental.CommunicationImplementation.RING
    ),
]


# -- 4. options= on reduce_to and batch_reduce_to -------------------------------------------------


@pytest.mark.parametrize("options", OPTIONS, ids=["none", "packs", "ring"])
def test_reduce_to_and_batch_reduce_to_take_options_in_cross_replica_context(group, options):
    # tf: replica r holds r + 1 (float32); reduce_to SUM == n (n + 1) / 2 (3.0), MEAN == (n + 1) / 2 (1.5);
    # batch_reduce_to gives one result per pair, the same numbers; options change nothing in the values.
    n, r = group.size, group.rank
    s = group.strategy
    with s.scope():
        x = np.float32(r + 1)
        total = s.extended.reduce_to("SUM", x, destinations="/cpu:0", options=options)
        mean = s.extended.reduce_to(mpistrat.ReduceOp.MEAN, x, "/cpu:0", options)
        both = s.extended.batch_reduce_to("SUM", [(x, "/cpu:0"), (2 * x, "/cpu:0")], options=options)
    want = n * (n + 1) / 2
    ok = float(total) == want and float(mean) == (n + 1) / 2 and [float(b) for b in both] == [want, 2 * want]
    all_ranks_agree(group.comm, ok and np.asarray(total).dtype == np.float32, f"{total!r} {mean!r} {both!r}")


@pytest.mark.parametrize("mode", ["root", "every_rank"])
def test_reduce_to_takes_options_inside_merge_fn_in_both_modes(group, mode):
    # tf: inside merge_fn, reduce_to(SUM, per-replica r + 1, options=...) == n (n + 1) / 2 (3.0)
    n = group.size
    s = strategy_in_mode(group, mode)
    opts = CommunicationOptions(bytes_per_pack=4)

    def merge_fn(strategy, x):
        one = strategy.extended.reduce_to("SUM", x, destinations="/cpu:0", options=opts)
        (two,) = strategy.extended.batch_reduce_to("MEAN", [(x, "/cpu:0")], options=opts)
        return one * 1.0, two * 1.0  # a Mirrored supports arithmetic, as tf's (reduce_to(...) * lr)

    one, two = in_merge_fn(s, merge_fn, np.float32(group.rank + 1))
    all_ranks_agree(group.comm, (float(one), float(two)) == (n * (n + 1) / 2, (n + 1) / 2), f"{one} {two}")


@pytest.mark.parametrize("mode", ["root", "every_rank"])
def test_options_of_the_wrong_type_fail_on_every_rank(group, mode):
    s = strategy_in_mode(group, mode)

    def merge_fn(strategy, x):
        return strategy.extended.reduce_to("SUM", x, destinations="/cpu:0", options={"bytes_per_pack": 4})

    raises_on_every_rank(group.comm, InvalidArgumentError, lambda: in_merge_fn(s, merge_fn, np.float32(1)))
    with s.scope():
        raises_on_every_rank(
            group.comm,
            InvalidArgumentError,
            lambda: s.extended.batch_reduce_to("SUM", [(np.float32(1), "/cpu:0")], options="fast"),
            "CommunicationOptions",
        )


def test_reduce_to_times_a_learning_rate_in_a_root_merge_fn(group):
    # tf: merge_fn returns reduce_to(SUM, 2.0 per replica) * 0.5 == n (2.0)
    got = in_merge_fn(
        group.strategy,
        lambda s, g: s.extended.reduce_to("SUM", g, destinations="/cpu:0") * 0.5,
        np.float32(2),
    )
    all_ranks_agree(group.comm, float(got) == group.size, repr(got))


# -- 6. compute_average_loss's context ----------------------------------------------------------


def test_compute_average_loss_in_cross_replica_context_is_tfs(group):
    # tf 2.21 (nn_impl_distribute.compute_average_loss): in strategy.scope() with global_batch_size it
    # returns sum / global_batch_size (0.75 for [1, 2] over 4); without it, RuntimeError.
    with group.strategy.scope():
        got = mpistrat.compute_average_loss(np.array([1.0, 2.0], np.float32), global_batch_size=4)
        raises_on_every_rank(
            group.comm,
            RuntimeError,
            lambda: mpistrat.compute_average_loss(np.array([1.0, 2.0], np.float32)),
            "cross replica context",
        )
    all_ranks_agree(group.comm, float(got) == 0.75 and got.dtype == np.float32, repr(got))


# -- 1. MultiWorkerMirroredStrategy -------------------------------------------------------------


def test_multi_worker_strategy_is_every_rank_of_the_world():
    # tf (one worker): num_replicas_in_sync 1, cluster_resolver.task_type/task_id None/None for an empty
    # TF_CONFIG; here MPI is the cluster: n replicas, task ("worker", rank).
    world = MPI.COMM_WORLD
    n, r = world.Get_size(), world.Get_rank()
    s = mpistrat.MultiWorkerMirroredStrategy(
        communication_options=mpistrat.experimental.CommunicationOptions(bytes_per_pack=1 << 20)
    )
    checks = RankChecks()
    checks.that(s.num_replicas_in_sync == n and s.extended.merge_call_mode == "every_rank")
    checks.that((s.cluster_resolver.task_type, s.cluster_resolver.task_id) == ("worker", r))
    checks.that(s.extended.communication_options.bytes_per_pack == 1 << 20)
    checks.that(
        isinstance(s, mpistrat.MPIStrategy) and mpistrat.experimental.MultiWorkerMirroredStrategy is type(s)
    )

    def merge_fn(strategy, x):  # on every worker, with its own value: reduce is a collective
        return strategy.reduce("SUM", x, axis=None), mpistrat.in_cross_replica_context()

    total, cross = in_merge_fn(s, merge_fn, np.float32(r + 1))
    checks.that(float(total) == n * (n + 1) / 2 and cross)
    checks.agree(world, f"{s} {total}")


# -- 5. PreemptionWatcher --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_preemption_watcher_reports_an_agreed_signal_on_every_rank(world):
    from mpistrat.checkpoint import preemption

    s = mpistrat.MPIStrategy(world.comm)
    with s.scope():
        watcher = mpistrat.experimental.PreemptionWatcher()
        try:
            before = watcher.preemption_message
            if world.rank == 0:
                os.kill(os.getpid(), signal.SIGUSR1)  # what scancel --signal=USR1 does
            s.reduce("SUM", np.float32(1))  # the next collective carries it to every rank
            after = watcher.preemption_message
            watcher.block_until_worker_exit()  # nothing to wait for (tf: a no-op off TPUs)
        finally:
            preemption._unwatch_signals()
            s.extended.collectives.stop.clear()
    where = "SIGUSR1 on rank 0" if world.rank == 0 else "on another rank"
    all_ranks_agree(world.comm, before is None and after is not None and where in after, repr(after))


# -- 7. variables' signatures, constraint, deepcopy, aggregation=None ----------------------------


def test_assign_takes_tfs_arguments_and_read_value_false_returns_none(group):
    # tf: assign(x, read_value=False) -> None in both contexts; with read_value True, the variable
    with group.strategy.scope():
        v = mpistrat.Variable(np.float32(1.0), aggregation=mpistrat.VariableAggregation.MEAN)
        a = v.assign(np.float32(3.0), read_value=False)
        b = v.assign_add(np.float32(1.0), use_locking=True, name="x")
        c = v.assign_sub(np.float32(0.5), False, "y", True)
    d = group.strategy.run(lambda: v.assign(np.float32(5.0), read_value=False))
    plain = mpistrat.Variable(np.float32(1.0))
    e = plain.assign(np.float32(2.0), read_value=False)
    ok = a is None and b is v and c is v and d is None and e is None
    all_ranks_agree(group.comm, ok and float(v.numpy()) == 5.0 and float(plain.numpy()) == 2.0)


def test_constraint_is_kept_and_not_applied_by_assign():
    # tf: Variable(1.0, constraint=lambda x: minimum(x, 2)).assign(5.0) holds 5.0; .constraint is the fn
    def clip(x):
        return np.minimum(x, 2)

    v = mpistrat.Variable(np.float32(1.0), constraint=clip)
    v.assign(np.float32(5.0))
    assert v.constraint is clip and float(v.numpy()) == 5.0
    assert mpistrat.Variable(1.0).constraint is None
    with pytest.raises(ValueError, match="must be a callable"):
        mpistrat.Variable(1.0, constraint=3)


def test_aggregation_none_means_none(group):
    # tf: Variable(1.0, aggregation=None).aggregation == VariableAggregation.NONE, plain and mirrored
    with group.strategy.scope():
        v = mpistrat.Variable(np.float32(1.0), aggregation=None)
    w = mpistrat.Variable(np.float32(1.0), aggregation=None)
    ok = v.aggregation is w.aggregation is mpistrat.VariableAggregation.NONE
    all_ranks_agree(group.comm, ok)


def test_deepcopy_of_variables(group):
    # tf: copy.deepcopy(mirrored) is a new MirroredVariable with the value (4.0); of a plain
    # variable, a new variable (2.0); writing the copy leaves the original alone.
    with group.strategy.scope():
        v = mpistrat.Variable(np.float32(4.0), aggregation="MEAN")
        c = copy.deepcopy(v)
        c.assign(np.float32(7.0))
        sor = mpistrat.Variable(np.float32(0.0), synchronization="ON_READ", aggregation="SUM")
    group.strategy.run(lambda: sor.assign(np.float32(group.rank + 1)))
    csor = copy.deepcopy(sor)  # outside the scope too; each rank keeps its own copy
    with group.strategy.scope():
        summed = float(csor.numpy())
    p = mpistrat.Variable(np.float32(2.0))
    cp = copy.deepcopy(p)
    checks = RankChecks()
    checks.that(
        type(c) is mpistrat.MirroredVariable
        and c is not v
        and float(v.numpy()) == 4.0
        and float(c.numpy()) == 7.0
    )
    checks.that(type(csor) is mpistrat.SyncOnReadVariable and summed == group.size * (group.size + 1) / 2)
    checks.that(cp is not p and float(cp.numpy()) == 2.0)
    checks.agree(group.comm, f"{c!r} {summed}")


# -- 7. merge_call results every rank holds need no pickling ---------------------------------------


@pytest.mark.parametrize("mode", ["root", "every_rank"])
def test_merge_call_returning_the_strategy_is_a_barrier(group, mode):
    # tf: merge_call(lambda strategy: strategy) returns the strategy (True for `is`)
    s = strategy_in_mode(group, mode)
    with s.scope():
        v = mpistrat.Variable(np.float32(1.0))
    got = s.run(lambda: mpistrat.get_replica_context().merge_call(lambda st: (st, st.extended, v)))
    all_ranks_agree(group.comm, got[0] is s and got[1] is s.extended and got[2] is v, repr(got))


# -- 7. mixing strategies, experimental_set_strategy, the default strategy's contexts --------------


def test_one_strategys_methods_in_anothers_scope_raise_runtime_error(world):
    # tf: RuntimeError("Mixing different tf.distribute.Strategy objects: ...") for reduce and
    # make_input_fn_iterator of s2 inside s1.scope()
    other = mpistrat.MPIStrategy(MPI.COMM_SELF)
    with world.strategy.scope():
        with pytest.raises(RuntimeError, match="Mixing different"):
            other.reduce("SUM", np.float32(1.0), axis=None)
        with pytest.raises(RuntimeError, match="Mixing different"):
            other.make_input_fn_iterator(lambda ctx: [np.arange(4)])
        with pytest.raises(RuntimeError, match="Mixing different"):
            other.run(lambda: None)


def test_experimental_set_strategy_is_tfs(world):
    # tf: after set(s): get_strategy() is s, has_strategy() True, in_cross_replica_context() True;
    # set(None) restores the default; inside a scope: RuntimeError("Must not be called inside ...")
    s = world.strategy
    mpistrat.experimental_set_strategy(s)
    try:
        got = (mpistrat.get_strategy() is s, mpistrat.has_strategy(), mpistrat.in_cross_replica_context())
        with s.scope():  # its own scope may still be entered
            pass
        mpistrat.experimental_set_strategy(mpistrat.MPIStrategy(MPI.COMM_SELF))  # tf: set twice is fine
    finally:
        mpistrat.experimental_set_strategy(None)
    assert got == (True, True, True) and not mpistrat.has_strategy()
    with s.scope(), pytest.raises(RuntimeError, match="Must not be called inside"):
        mpistrat.experimental_set_strategy(s)


def test_the_default_strategys_contexts_are_tfs():
    # tf: in the default strategy's merge_fn has_strategy() False, in_cross_replica_context() True,
    # get_replica_context() None, get_strategy() is it; in its scope() has_strategy() False and the
    # default replica context is current (in_cross_replica_context() False).
    default = mpistrat.get_strategy()
    got = mpistrat.get_replica_context().merge_call(
        lambda s: (
            mpistrat.has_strategy(),
            mpistrat.in_cross_replica_context(),
            mpistrat.get_replica_context() is None,
            mpistrat.get_cross_replica_context() is s,
            mpistrat.get_strategy() is s is default,
        )
    )
    assert got == (False, True, True, True, True)
    with default.scope():
        got = (
            mpistrat.has_strategy(),
            mpistrat.get_replica_context() is not None,
            mpistrat.in_cross_replica_context(),
        )
    assert got == (False, True, False)


def test_errors_are_mpistrats_own_types():
    assert issubclass(ContextError, RuntimeError)


# -- 8. CheckpointManager when a rank passes another directory (the tutorial's workers) ----------


@pytest.mark.timeout(60)
def test_a_workers_own_checkpoint_directory_is_accepted_and_rank_0_writes(world):
    import tempfile

    base = world.comm.bcast(tempfile.mkdtemp() if world.rank == 0 else None)
    mine = os.path.join(base, "ckpt" if world.rank == 0 else f"workertemp_{world.rank}", "ckpt")
    with world.strategy.scope():
        v = mpistrat.Variable(np.float32(3.0))
    manager = mpistrat.CheckpointManager(mpistrat.Checkpoint(v=v), mine, max_to_keep=1)
    path = manager.save()
    want = os.path.join(base, "ckpt", "ckpt", "ckpt-1")
    world.comm.Barrier()
    checks = RankChecks()
    checks.that(path == want and manager.latest_checkpoint == want and os.path.exists(want))
    checks.that(os.path.isdir(mine) and (world.rank == 0 or os.listdir(mine) == []))
    checks.that(mpistrat.latest_checkpoint(os.path.join(base, "ckpt", "ckpt")) == want)
    checks.agree(world.comm, f"{path} {os.listdir(base)}")
