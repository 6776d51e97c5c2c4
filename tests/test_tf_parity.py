"""Where a ported tf.distribute program must get what tf.distribute gives.

Each expected value is tf's, measured with TensorFlow 2.21's ``MirroredStrategy`` on 1, 2 and 3
logical CPU devices, and written here as a formula of the number of replicas ``n`` with tf's
value at 2 replicas in the comment. Replica ``r`` of the tests is the rank ``r``.
"""

import numpy as np
import pytest

import mpistrat
from mpistrat import ContextError, InvalidArgumentError, PerReplica
from tests.conftest import RankChecks, all_ranks_agree, in_merge_fn, raises_on_every_rank, strategy_in_mode

# -- 1. Strategy.reduce(MEAN, axis=k) keeps the float dtype -------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int32])
def test_reduce_along_an_axis_keeps_float_dtypes(group, dtype):
    # tf: replica r holds [1, 2, 4] * (r + 1); reduce(MEAN, axis=0) == 7 (n + 1) / 6 (3.5 at 2
    # replicas) as float32 for float32, float16 for float16, float64 for int32; SUM keeps the dtype (21).
    n, r = group.size, group.rank
    value = (np.array([1, 2, 4]) * (r + 1)).astype(dtype)
    with group.strategy.scope():
        mean = group.strategy.reduce("MEAN", value, axis=0)
        total = group.strategy.reduce("SUM", value, axis=0)
    want_dtype = np.float64 if dtype is np.int32 else dtype
    checks = RankChecks()
    checks.that(mean.dtype == want_dtype and np.isclose(float(mean), 7 * (n + 1) / 6, rtol=1e-3))
    checks.that(total.dtype == dtype and float(total) == 7 * n * (n + 1) / 2)
    checks.agree(group.comm, f"{mean!r} {total!r}")


def test_mean_in_a_merge_fn_keeps_float32(group):
    # tf: reduce(MEAN) of a float32 PerReplica is float32 (5.5 for (1.0, 10.0)).
    n = group.size
    components = tuple(np.float32(10**i) for i in range(n))

    def merge_fn(strategy, _):
        return strategy.reduce("MEAN", PerReplica(components), axis=None)

    got = in_merge_fn(group.strategy, merge_fn, np.zeros(1))
    want = np.float32(sum(components) / n)
    all_ranks_agree(group.comm, got.dtype == np.float32 and got == want, f"{got!r}")


# -- 2. One merge-context reducer ---------------------------------------------------------------


@pytest.mark.parametrize("method", ["reduce", "reduce_to"])
def test_merge_fn_reductions_give_tfs_answers(group, method):
    # tf, inside merge_fn: reduce and extended.reduce_to agree. PerReplica((1.0,)) gives 1.0 for SUM
    # and MEAN; PerReplica((1, 10, ..., 10**(n-1))) gives their sum (11.0 at 2) and mean (5.5); a plain
    # value gives itself for MEAN (3.0) and a ValueError for SUM unless n is 1; merge_fn's received
    # argument (r + 1 on replica r) sums to n (n + 1) / 2 (3.0).
    n = group.size

    def reduce(strategy, op, value):
        if method == "reduce":
            return strategy.reduce(op, value, axis=None)
        return strategy.extended.reduce_to(op, value, destinations="/cpu:0")

    def merge_fn(strategy, x):
        plain_sum = reduce(strategy, "SUM", np.float64(3.0)) if n == 1 else None
        everyone = PerReplica(tuple(np.float64(10**i) for i in range(n)))
        return [
            reduce(strategy, "SUM", PerReplica((np.float64(1.0),))),
            reduce(strategy, "MEAN", PerReplica((np.float64(1.0),))),
            reduce(strategy, "SUM", everyone),
            reduce(strategy, "MEAN", everyone),
            reduce(strategy, "MEAN", np.float64(3.0)),
            reduce(strategy, "SUM", x),
            plain_sum,
        ]

    got = in_merge_fn(group.strategy, merge_fn, np.float64(group.rank + 1))
    got = [None if v is None else float(getattr(v, "values", (v,))[0]) for v in got]
    tens = sum(10**i for i in range(n))
    want = [1.0, 1.0, tens, tens / n, 3.0, n * (n + 1) / 2, 3.0 if n == 1 else None]
    all_ranks_agree(group.comm, got == want, f"{got} != {want}")
    if n > 1:
        raises_on_every_rank(
            group.comm,
            ValueError,
            lambda: in_merge_fn(group.strategy, lambda s, x: reduce(s, "SUM", np.float64(3.0)), 0),
            "cannot be reduced with SUM",
        )


@pytest.mark.parametrize("mode", ["root", "every_rank"])
@pytest.mark.parametrize("method", ["reduce", "reduce_to", "batch_reduce_to"])
def test_per_replica_with_the_wrong_component_count_fails_every_rank(group, mode, method):
    # tf sums whatever components a PerReplica has (111.0 for 3 components on 2 replicas); here a
    # count that is neither 1 nor n is an error, raised on every rank in both merge modes.
    s = strategy_in_mode(group, mode)
    wrong = PerReplica(tuple(np.float64(1.0) for _ in range(group.size + 1)))

    def merge_fn(strategy, _):
        if method == "reduce":
            return strategy.reduce("SUM", wrong, axis=None)
        if method == "reduce_to":
            return strategy.extended.reduce_to("SUM", wrong, destinations="/cpu:0")
        return strategy.extended.batch_reduce_to(
            "SUM", [(PerReplica((np.float64(1.0),)), "/cpu:0"), (wrong, "/cpu:0")]
        )

    raises_on_every_rank(
        group.comm, InvalidArgumentError, lambda: in_merge_fn(s, merge_fn, np.zeros(1)), "components"
    )
    after = s.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1))
    all_ranks_agree(group.comm, int(after) == group.size, f"{after}")


def test_per_replica_with_the_wrong_component_count_in_cross_replica_context(group):
    # Ranks that disagree on the count must not leave one rank in the all-reduce alone.
    n, r = group.size, group.rank
    wrong = PerReplica(tuple(np.float64(1.0) for _ in range(n + 1 if r == 0 else n)))

    def call():
        with group.strategy.scope():
            return group.strategy.reduce("SUM", wrong, axis=None)

    if n == 1:
        raises_on_every_rank(group.comm, InvalidArgumentError, call, "components")
        return
    try:
        call()
        error = None
    except InvalidArgumentError as exc:
        error = str(exc)
    all_ranks_agree(group.comm, error is not None, "expected an error on every rank")


# -- 3. Variables in collectives ----------------------------------------------------------------


def make_variables(group, s=None):
    s = s or group.strategy
    with s.scope():
        mirrored = mpistrat.Variable(np.float32(2.0))
        on_read = {
            agg: mpistrat.Variable(np.float32(0.0), synchronization="ON_READ", aggregation=agg)
            for agg in ("SUM", "MEAN", "ONLY_FIRST_REPLICA")
        }
    rank = group.rank
    s.run(lambda: [v.assign(np.float32(rank + 1)) for v in on_read.values()])
    return mirrored, on_read


def test_variables_in_all_reduce_read_their_local_copy(group):
    # tf: in replica context all_reduce(SUM, mirrored variable 2.0) == 2 n (4.0 at 2 replicas);
    # all_reduce(SUM, sync-on-read variable whose copy on replica r is r + 1) == n (n + 1) / 2 (3.0).
    n = group.size
    mirrored, on_read = make_variables(group)

    def step():
        ctx = mpistrat.get_replica_context()
        return (
            ctx.all_reduce("SUM", mirrored),
            ctx.all_reduce("MEAN", on_read["MEAN"]),
            ctx.all_reduce("SUM", [on_read["SUM"], 1.0]),
        )

    total, mean, (copies, one) = group.strategy.run(step)
    ok = total == 2 * n and total.dtype == np.float32 and mean == (n + 1) / 2 and copies == n * (n + 1) / 2
    all_ranks_agree(group.comm, ok and one == n, f"{total!r} {mean!r} {copies!r} {one!r}")


def test_strategy_reduce_of_variables(group):
    # tf: reduce(SUM, sync-on-read variable) sums the replicas' copies whatever the aggregation
    # (copies r + 1: n (n + 1) / 2, 3.0 at 2 replicas), MEAN averages them (1.5), and so does
    # extended.reduce_to; reduce(MEAN, mirrored variable 2.0) == 2.0. tf raises AssertionError for
    # reduce(SUM, mirrored variable); SPMD counts each rank's copy: 2 n.
    n = group.size
    mirrored, on_read = make_variables(group)
    with group.strategy.scope():
        got = [float(group.strategy.reduce("SUM", v, axis=None)) for v in on_read.values()]
        got.append(float(group.strategy.reduce("MEAN", on_read["SUM"], axis=None)))
        got.append(float(group.strategy.extended.reduce_to("SUM", on_read["SUM"], destinations=mirrored)))
        got.append(float(group.strategy.reduce("MEAN", mirrored, axis=None)))
        got.append(float(group.strategy.reduce("SUM", mirrored, axis=None)))
    s = n * (n + 1) / 2
    want = [s, s, s, (n + 1) / 2, s, 2.0, 2.0 * n]
    all_ranks_agree(group.comm, got == want, f"{got} != {want}")


def test_sync_on_read_variable_in_a_root_merge_fn_is_refused(group):
    # Rank 0 alone holds only its own copy: the sum of the copies tf gives is not there.
    _, on_read = make_variables(group)
    raises_on_every_rank(
        group.comm,
        ContextError,
        lambda: in_merge_fn(group.strategy, lambda s, _: s.reduce("SUM", on_read["SUM"], axis=None), 0),
        "sync-on-read",
    )


# -- 5. Losses ----------------------------------------------------------------------------------


def test_scale_regularization_loss(group):
    # tf.nn.scale_regularization_loss in replica context: reduce_sum(loss) / n, dtype kept:
    # [1.0, 5.0] -> 6 / n (3.0 at 2 replicas); float16 6.0 -> float16 6 / n; [6.0, 3.0] -> 9 / n.
    n = group.size

    def step():
        return (
            mpistrat.scale_regularization_loss(np.array([1.0, 5.0], np.float32)),
            mpistrat.scale_regularization_loss(np.float16(6.0)),
            mpistrat.scale_regularization_loss([np.float32(6.0), np.float32(3.0)]),
        )

    a, b, c = group.strategy.run(step)
    ok = a.dtype == np.float32 and np.isclose(a, 6 / n) and b.dtype == np.float16 and np.isclose(b, 6 / n)
    all_ranks_agree(group.comm, ok and c.dtype == np.float32 and np.isclose(c, 9 / n), f"{a!r} {b!r} {c!r}")


def test_scale_regularization_loss_refuses_cross_replica_context(group):
    # tf: RuntimeError "You are calling `scale_regularization_loss` in cross replica context"; outside
    # any strategy it divides by 1 (6.0).
    def in_scope():
        with group.strategy.scope():
            return mpistrat.scale_regularization_loss(np.float32(6.0))

    raises_on_every_rank(group.comm, RuntimeError, in_scope, "cross replica context")
    raises_on_every_rank(
        group.comm,
        RuntimeError,
        lambda: in_merge_fn(group.strategy, lambda s, _: mpistrat.scale_regularization_loss(1.0), 0),
        "cross replica context",
    )
    assert float(mpistrat.scale_regularization_loss(np.float32(6.0))) == 6.0


def test_compute_average_loss_on_uneven_batches_counts_the_examples(group):
    # A documented difference: replica r has r + 1 examples of loss 1. tf divides by the local size
    # times n, so each replica gives 1 / n and their sum is 1 whatever the weights of the batches;
    # mpistrat divides by the step's examples, n (n + 1) / 2, so the sum is the exact mean, 1.
    # On even batches both give the same: 2 examples per replica -> 2 / (2 n) for tf and here.
    n, r = group.size, group.rank
    uneven, even = group.strategy.run(
        lambda: (mpistrat.compute_average_loss(np.ones(r + 1)), mpistrat.compute_average_loss(np.ones(2)))
    )
    tf_even = 2 / (2 * n)
    ok = np.isclose(uneven, (r + 1) / (n * (n + 1) / 2)) and np.isclose(even, tf_even)
    all_ranks_agree(group.comm, ok, f"{uneven} {even}")


# -- 6. Sync-on-read writes in cross-replica context ----------------------------------------------


@pytest.mark.parametrize("where", ["scope", "root", "every_rank"])
@pytest.mark.parametrize("how", ["assign_add", "assign_sub"])
def test_sync_on_read_updates_in_cross_replica_context(group, where, how):
    # tf: MEAN and ONLY_FIRST_REPLICA sync-on-read variables accept assign_add/assign_sub in
    # cross-replica context and apply them to every replica's copy (copies 1, 1 -> 2, 2 after
    # assign_add(1.0)); SUM refuses them with ValueError ("does not support `assign_add` in
    # cross-replica context when aggregation is set to `tf.VariableAggregation.SUM`").
    r = group.rank
    s = strategy_in_mode(group, "root" if where == "scope" else where)
    _, on_read = make_variables(group, s)
    sign = 1 if how == "assign_add" else -1

    def update(aggs):
        for agg in aggs:
            getattr(on_read[agg], how)(np.float32(1.0))

    def call(aggs):
        if where == "scope":
            with s.scope():
                return update(aggs)
        return in_merge_fn(s, lambda _strategy, _: update(aggs), 0)

    call(["MEAN", "ONLY_FIRST_REPLICA"])
    copies = [float(on_read[agg]._local()) for agg in ("MEAN", "ONLY_FIRST_REPLICA")]
    all_ranks_agree(group.comm, copies == [r + 1 + sign] * 2, f"{copies}")
    raises_on_every_rank(group.comm, ValueError, lambda: call(["SUM"]), "cross-replica context")


# -- 7. strategy.run inside merge_fn ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["root", "every_rank"])
def test_run_inside_merge_fn(group, mode):
    # tf: strategy.run inside merge_fn runs fn once per replica with that replica's component;
    # merge_fn returning the PerReplica gives replica r its own result: 10 (r + 1) + r (10.0, 21.0
    # at 2 replicas); reduce(SUM) of run(y * 2) gives n (n + 1) (6.0 at 2).
    s = strategy_in_mode(group, mode)
    n, r = group.size, group.rank

    def own(strategy, x):
        return strategy.run(
            lambda y: y * 10 + mpistrat.get_replica_context().replica_id_in_sync_group, args=(x,)
        )

    def reduced(strategy, x):
        return strategy.reduce("SUM", strategy.run(lambda y: y * 2, args=(x,)), axis=None)

    got = in_merge_fn(s, own, np.float32(r + 1))
    total = in_merge_fn(s, reduced, np.float32(r + 1))
    ok = got == 10 * (r + 1) + r and got.dtype == np.float32 and total == n * (n + 1)
    all_ranks_agree(group.comm, ok, f"{got!r} {total!r}")


@pytest.mark.parametrize("mode", ["root", "every_rank"])
def test_collectives_in_run_inside_merge_fn(group, mode):
    # tf: all_reduce(SUM) inside strategy.run inside merge_fn gives n (n + 1) / 2 (3.0 at 2 replicas).
    # In root mode merge_fn runs on rank 0 alone, so the collective is refused on every rank instead.
    s = strategy_in_mode(group, mode)
    n, r = group.size, group.rank

    def merge_fn(strategy, x):
        return strategy.run(lambda y: mpistrat.get_replica_context().all_reduce("SUM", y), args=(x,))

    if mode == "root":
        raises_on_every_rank(
            group.comm, ContextError, lambda: in_merge_fn(s, merge_fn, np.float32(r + 1)), "rank 0"
        )
    else:
        got = in_merge_fn(s, merge_fn, np.float32(r + 1))
        all_ranks_agree(group.comm, got == n * (n + 1) / 2, f"{got!r}")
    after = s.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1))
    all_ranks_agree(group.comm, int(after) == n, f"{after}")


def test_variables_in_run_inside_a_root_merge_fn(group):
    # Reading a mirrored variable works (every rank's copy is rank 0's); writing it would need the
    # other ranks, so it is refused on every rank.
    mirrored, _ = make_variables(group)

    def read(strategy, _):
        return strategy.run(lambda: mirrored.value() + 1)

    got = in_merge_fn(group.strategy, read, 0)
    all_ranks_agree(group.comm, got == 3.0, f"{got!r}")
    raises_on_every_rank(
        group.comm,
        ContextError,
        lambda: in_merge_fn(group.strategy, lambda s, _: s.run(lambda: mirrored.assign(1.0)), 0),
        "rank 0",
    )


def test_variables_of_different_shapes_in_all_reduce_name_the_shapes(group):
    # Not a tf value: ranks that disagree about a variable's shape get an error naming both shapes.
    if group.size == 1:
        pytest.skip("needs two ranks to disagree")
    var = mpistrat.Variable(np.zeros(group.rank + 1, np.float32))
    message = raises_on_every_rank(
        group.comm,
        mpistrat.CollectiveMismatchError,
        lambda: group.strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", {"v": var})),
    )
    all_ranks_agree(group.comm, "shape (1,)" in message and "shape (2,)" in message, message)
