"""Distributed variables: each synchronization x aggregation x context, against a serial computation.

Replica ``r`` starts from ``10 + 100 r`` (only rank 0's value may survive creation) and
contributes ``u_r = r + 1`` (the issue's ``assign_add(replica_id + 1)``).
"""

import pickle

import numpy as np
import pytest

import mpistrat
from mpistrat import (
    CollectiveMismatchError,
    ContextError,
    InvalidArgumentError,
    VariableAggregation,
    VariableSynchronization,
)
from tests.conftest import RankChecks, all_ranks_agree, raises_on_every_rank

AGGREGATIONS = ["NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA"]
HOWS = ["assign", "assign_add", "assign_sub"]
INIT = 10.0


def updates(n):
    return [float(r + 1) for r in range(n)]


def serial_combine(agg, values):
    if agg == "SUM":
        return sum(values)
    if agg == "MEAN":
        return sum(values) / len(values)
    return values[0]


def serial_write(how, old, value):
    return {"assign": value, "assign_add": old + value, "assign_sub": old - value}[how]


def make(group, sync, agg, init=None):
    with group.strategy.scope():
        return mpistrat.Variable(
            INIT + 100 * group.rank if init is None else init, synchronization=sync, aggregation=agg
        )


def read_everywhere(group, var):
    with group.strategy.scope():
        return float(var.numpy())


def test_issue_examples(group):
    n = group.size
    mean_var = make(group, "ON_WRITE", "MEAN")
    sum_var = make(group, "ON_READ", "SUM", init=0.0)

    def step():
        rid = mpistrat.get_replica_context().replica_id_in_sync_group
        mean_var.assign_add(rid + 1)
        sum_var.assign_add(rid + 1)

    group.strategy.run(step)
    got = (read_everywhere(group, mean_var), read_everywhere(group, sum_var))
    want = (INIT + sum(updates(n)) / n, sum(updates(n)))
    if n == 3:
        want = (12.0, 6.0)  # the issue's numbers
    all_ranks_agree(group.comm, got == want, f"{got} != {want}")


def test_creation_broadcasts_rank_0_value(group):
    for sync in ("AUTO", "ON_WRITE", "ON_READ"):
        var = make(group, sync, "SUM")
        local = float(var._local())
        all_ranks_agree(group.comm, local == INIT, f"{sync}: {local}")
    with group.strategy.scope():
        from_callable = mpistrat.Variable(lambda: np.full(3, group.rank, dtype=np.float32))
    ok = from_callable.dtype == np.float32 and from_callable.numpy().tolist() == [0.0] * 3
    all_ranks_agree(group.comm, ok, repr(from_callable))


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_mirrored_write_in_replica_context(group, agg, how):
    var = make(group, "AUTO", agg)
    assert isinstance(var, mpistrat.MirroredVariable)

    def step():
        rid = mpistrat.get_replica_context().replica_id_in_sync_group
        return float(getattr(var, how)(np.float64(rid + 1)).numpy())  # a value of the replica's own

    if agg == "NONE" and group.size > 1:  # each replica's own value: the copies would differ
        raises_on_every_rank(
            group.comm, CollectiveMismatchError, lambda: group.strategy.run(step), "aggregation"
        )
        return
    in_replica = group.strategy.run(step)
    want = serial_write(how, INIT, serial_combine(agg, updates(group.size)))
    got = (in_replica, read_everywhere(group, var))
    all_ranks_agree(group.comm, got == (want, want), f"{got} != {want}")


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_sync_on_read_write_in_replica_context(group, agg, how):
    var = make(group, "ON_READ", agg)
    assert isinstance(var, mpistrat.SyncOnReadVariable) and not var.trainable

    def step():
        rid = mpistrat.get_replica_context().replica_id_in_sync_group
        return float(getattr(var, how)(rid + 1).numpy())  # replica context reads the local copy

    in_replica = group.strategy.run(step)
    locals_ = [serial_write(how, INIT, u) for u in updates(group.size)]
    all_ranks_agree(group.comm, in_replica == locals_[group.rank], f"{in_replica} != {locals_[group.rank]}")
    if agg == "NONE":
        raises_on_every_rank(group.comm, InvalidArgumentError, lambda: read_everywhere(group, var), "NONE")
        return
    got, want = read_everywhere(group, var), serial_combine(agg, locals_)
    all_ranks_agree(group.comm, got == want, f"{got} != {want}")


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("sync", ["ON_WRITE", "ON_READ"])
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_write_in_cross_replica_context(group, sync, agg, how):
    var = make(group, sync, agg)
    value = np.float64(7.0)
    if sync == "ON_READ" and agg == "SUM" and how != "assign":
        # tf: "SyncOnReadVariable does not support `assign_add` in cross-replica context when
        # aggregation is set to `tf.VariableAggregation.SUM`" (ValueError); other aggregations
        # apply the update to every replica's copy.
        with group.strategy.scope(), pytest.raises(ValueError, match="cross-replica"):
            getattr(var, how)(value)
        return
    with group.strategy.scope():
        getattr(var, how)(value)
    unreadable = sync == "ON_READ" and agg == "NONE"  # read its local copy instead
    got = float(var._local()) if unreadable else read_everywhere(group, var)
    all_ranks_agree(group.comm, got == serial_write(how, INIT, 7.0), f"{got}")


@pytest.mark.parametrize("sync", ["ON_WRITE", "ON_READ"])
@pytest.mark.parametrize("agg", ["SUM", "MEAN", "ONLY_FIRST_REPLICA"])
def test_write_inside_merge_fn_reaches_every_rank(group, sync, agg):
    var = make(group, sync, agg)

    def merge_fn(strategy, v):
        assert v is var  # a variable is passed as rank 0's own object
        v.assign(np.float64(4.0) * strategy.num_replicas_in_sync)

    group.strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn, args=(var,)))
    got = read_everywhere(group, var)
    all_ranks_agree(group.comm, got == 4.0 * group.size, f"{got}")


def test_vector_mirrored_sum_against_serial(group):
    with group.strategy.scope():
        var = mpistrat.Variable(np.zeros(2, np.float32), aggregation=VariableAggregation.SUM)

    def step():
        rid = mpistrat.get_replica_context().replica_id_in_sync_group
        var.assign_add(np.array([rid + 1, 2 * (rid + 1)], np.float32))

    group.strategy.run(step)
    want = np.array([sum(updates(group.size)), 2 * sum(updates(group.size))], np.float32)
    ok = var.dtype == np.float32 and np.array_equal(var.numpy(), want)
    all_ranks_agree(group.comm, ok, repr(var))


def test_bad_write_on_one_rank_fails_every_rank(group):
    var = make(group, "ON_WRITE", "SUM")

    def step():
        rid = mpistrat.get_replica_context().replica_id_in_sync_group
        var.assign_add(np.ones(2) if rid == group.size - 1 else np.float64(1.0))

    raises_on_every_rank(group.comm, InvalidArgumentError, lambda: group.strategy.run(step), "shape")
    all_ranks_agree(group.comm, read_everywhere(group, var) == INIT)
    after = group.strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1))
    all_ranks_agree(group.comm, after == group.size)


@pytest.mark.parametrize("sync", ["ON_WRITE", "ON_READ"])
def test_integer_variable_with_mean_aggregation_is_refused_at_creation(group, sync):
    # tf: "creating distributed tf.Variable with aggregation=MEAN and a non-floating dtype is not
    # supported" (ValueError), for ON_WRITE and ON_READ alike; SUM and ONLY_FIRST_REPLICA are accepted.
    def create():
        with group.strategy.scope():
            return mpistrat.Variable(np.int32(1), synchronization=sync, aggregation="MEAN")

    raises_on_every_rank(group.comm, InvalidArgumentError, create, "non-floating")
    with group.strategy.scope():
        for agg in ("SUM", "ONLY_FIRST_REPLICA"):
            assert mpistrat.Variable(np.int32(1), synchronization=sync, aggregation=agg).dtype == np.int32


def test_creation_with_different_shapes_fails_every_rank(group):
    if group.size == 1:
        pytest.skip("needs two ranks to disagree")

    def create():
        with group.strategy.scope():
            mpistrat.Variable(np.zeros(2 if group.rank == 0 else 3))

    raises_on_every_rank(group.comm, CollectiveMismatchError, create, "shape")


def test_creation_rules(world):
    strategy = world.strategy
    with strategy.scope():
        with pytest.raises(InvalidArgumentError, match="NONE"):
            mpistrat.Variable(1.0, synchronization=VariableSynchronization.NONE)
        assert mpistrat.Variable(1.0, synchronization="ON_READ", trainable=True).trainable  # as tf.Variable
        with pytest.raises(InvalidArgumentError, match="aggregation"):
            mpistrat.Variable(1.0, aggregation="MAX")
    plain = mpistrat.Variable(1.0)
    assert type(plain) is mpistrat.Variable and plain.distribute_strategy is None

    def merge_fn(strategy):
        mpistrat.Variable(1.0)

    raises_on_every_rank(
        world.comm,
        ContextError,
        lambda: strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn)),
        "merge_fn",
    )
    in_replica = strategy.run(lambda: mpistrat.Variable(float(world.rank)))
    assert isinstance(in_replica, mpistrat.MirroredVariable) and float(in_replica.numpy()) == 0.0


def test_variable_from_another_strategy_is_an_error(world):
    other = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
    with world.strategy.scope():
        var = mpistrat.Variable(1.0)
    with other.scope(), pytest.raises(ContextError, match="belongs to"):
        var.assign(2.0)


def test_numpy_interop_and_dtype_rules():
    v = mpistrat.Variable(np.array([1.0, 2.0]), name="w")
    assert v.shape == (2,) and v.dtype == np.float64 and v.name == "w" and v.trainable
    assert np.asarray(v).tolist() == [1.0, 2.0] and np.sqrt(v).tolist() == [1.0, np.sqrt(2.0)]
    assert (v + 1).tolist() == [2.0, 3.0] and (1 - v).tolist() == [0.0, -1.0] and (2 * v).tolist() == [2, 4]
    assert (v / 2).tolist() == [0.5, 1.0] and (v**2).tolist() == [1.0, 4.0] and (-v).tolist() == [-1, -2]
    assert (v @ v) == 5.0 and (v == np.array([1.0, 0.0])).tolist() == [True, False] and len(v) == 2
    assert v[1] == 2.0 and (np.array([1.0, 1.0]) + v).tolist() == [2.0, 3.0]
    assert v.assign([3.0, 4.0]) is v and v.read_value().tolist() == [3.0, 4.0]
    snapshot = v.value()
    v.assign_sub([1.0, 1.0])
    assert snapshot.tolist() == [3.0, 4.0] and v.numpy().tolist() == [2.0, 3.0]
    with pytest.raises(InvalidArgumentError, match="shape"):
        v.assign(np.zeros(3))
    i = mpistrat.Variable(np.int32(1))
    with pytest.raises(InvalidArgumentError, match="float64"):
        i.assign(1.5)
    assert i.assign_add(2).dtype == np.int32 and int(i) == 3
    f = mpistrat.Variable(1.0, dtype=np.float32)
    assert f.assign_add(np.float64(0.5)).dtype == np.float32 and float(f) == 1.5
    assert "numpy=1.5" in repr(f) and {v: 1}[v] == 1


def test_pickling(world):
    plain = pickle.loads(pickle.dumps(mpistrat.Variable(np.arange(2.0), name="p")))
    assert plain.name == "p" and plain.numpy().tolist() == [0.0, 1.0]
    with world.strategy.scope():
        var = mpistrat.Variable(1.0)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(var)


def test_merge_fn_may_return_a_variable(group):
    var = make(group, "ON_WRITE", "SUM")
    got = group.strategy.run(lambda: mpistrat.get_replica_context().merge_call(lambda s: var))
    all_ranks_agree(group.comm, got is var)


def test_repr_reads_only_the_local_copy(group):
    var = make(group, "ON_READ", "SUM")
    text = repr(var)  # called on every rank would be fine anyway; no collective may happen here
    seq = group.strategy.extended.collectives.seq
    repr(var)
    assert group.strategy.extended.collectives.seq == seq
    assert text.startswith("SyncOnReadVariable:{") and f"{group.rank}: <mpistrat.Variable" in text


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sync", ["ON_WRITE", "ON_READ"])
@pytest.mark.parametrize("how", ["assign", "assign_add"])
def test_cross_replica_write_that_differs_between_ranks_fails_every_rank(world, sync, how):
    """Each rank writing its own value in cross-replica context would leave the copies silently
    different: it is an error on every rank naming the variable, and nothing is written."""
    if sync == "ON_READ" and how != "assign":
        pytest.skip("sync-on-read variables take only assign in cross-replica context")
    with world.strategy.scope():
        var = mpistrat.Variable(np.float32(1.0), name="lr", synchronization=sync, aggregation="MEAN")

    def write():
        with world.strategy.scope():
            getattr(var, how)(np.float32(world.rank))

    raises_on_every_rank(world.comm, mpistrat.CollectiveMismatchError, write, "'lr'")
    got = world.comm.allgather(float(var._local()))
    all_ranks_agree(world.comm, got == [1.0] * world.size, f"copies changed: {got}")
    with world.strategy.scope():  # the same value everywhere is fine
        getattr(var, how)(np.float32(2.0))
    got = world.comm.allgather(float(var._local()))
    want = 2.0 if how == "assign" else 3.0
    all_ranks_agree(world.comm, got == [want] * world.size, f"{got}")


@pytest.mark.parametrize("how", ["assign", "assign_add", "assign_sub"])
def test_a_value_read_before_a_write_keeps_its_value(group, how):
    """Writes reuse the variable's storage only when nothing else holds it (copy on write)."""
    with group.strategy.scope():
        var = mpistrat.Variable(np.arange(4, dtype=np.float32), name="w")
    before, view, as_array = var.value(), var.value()[1:3], np.asarray(var)
    mine = np.ones(4, np.float32)

    def write():
        with group.strategy.scope():
            getattr(var, how)(mine)

    write()
    mine[:] = 100.0  # the variable never keeps the caller's array
    want = {"assign": np.ones(4), "assign_add": np.arange(4) + 1, "assign_sub": np.arange(4) - 1}[how]
    checks = RankChecks()
    checks.that(
        before.tolist() == [0, 1, 2, 3]
        and view.tolist() == [1, 2]
        and as_array.tolist() == [0, 1, 2, 3]
        and var.numpy().tolist() == want.tolist()
    )
    write()  # nothing holds the value now: this write may go in place, with the same result
    again = {"assign": np.ones(4) * 100, "assign_add": want + 100, "assign_sub": want - 100}[how]
    checks.that(var.numpy().tolist() == again.tolist() and var.dtype == np.float32)
    checks.agree(group.comm, f"{before} {view} {as_array} {var.numpy()}")


@pytest.mark.parametrize(
    "dtype,how,value",
    [(np.uint8, "assign_add", 300), (np.int32, "assign_add", 2**31), (np.int64, "assign", 2**70)],
)
def test_python_ints_out_of_a_variables_range_are_refused_not_wrapped(group, dtype, how, value):
    plain = mpistrat.Variable(dtype(1))
    with pytest.raises(InvalidArgumentError, match="does not fit in the variable's"):
        getattr(plain, how)(value)
    assert plain.numpy() == 1
    with group.strategy.scope():
        v = mpistrat.Variable(dtype(1), name="v")
    # on one rank only, in cross-replica context: the error reaches every rank, nothing is written
    bad = group.rank == group.size - 1
    with group.strategy.scope():
        raises_on_every_rank(
            group.comm, InvalidArgumentError, lambda: getattr(v, how)(value if bad else 1), "does not fit"
        )
    all_ranks_agree(group.comm, v.numpy() == 1, f"{v.numpy()}")


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16])
def test_an_integer_sum_variable_reads_back_what_was_assigned_at_any_rank_count(group, dtype):
    """Its copies must sum to the value: 10 over 3 ranks is 4 + 3 + 3, not 3 + 3 + 3 (a restore
    at another rank count assigns the same way)."""
    want = np.array([10, 7, 0, 5], dtype)
    with group.strategy.scope():
        v = mpistrat.Variable(np.zeros(4, dtype), synchronization="ON_READ", aggregation="SUM")
        v.assign(want)
        got = v.numpy()
    copies = group.comm.allgather(v._local())
    ok = np.array_equal(got, want) and np.array_equal(sum(c.astype(np.int64) for c in copies), want)
    all_ranks_agree(group.comm, ok, f"read {got}, copies {copies}")


@pytest.mark.parametrize("how", ["assign", "assign_add", "assign_sub"])
def test_a_variable_made_outside_the_scope_cannot_be_written_in_replica_context(group, how):
    """Each rank would write its own value into its own copy: refused on every rank, written nowhere."""
    plain = mpistrat.Variable(np.zeros(2), name="plain")
    raises_on_every_rank(
        group.comm,
        ContextError,
        lambda: group.strategy.run(lambda: getattr(plain, how)(np.full(2, group.rank + 1.0))),
        "created outside strategy.scope()",
    )
    plain.assign_add(np.ones(2))  # outside run it is an ordinary local variable
    all_ranks_agree(group.comm, np.array_equal(plain.numpy(), np.ones(2)), f"{plain.numpy()}")
