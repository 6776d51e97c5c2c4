"""Errors a port catches and matches: tf's exception types and tf's words in mpistrat's messages.

Each case is the call that raises in tf 2.21 (a ``MirroredStrategy`` over 2 CPU devices, or one
replica where the case says so), the built-in type tf raises, and the text of tf's message that tf's
own tests and ported programs match (``assertRaisesRegex``, ``except ... if "..." in str(e)``),
copied from tf's message. mpistrat raises its own type, a subclass of tf's, and keeps tf's words in
its message beside its own explanation.
"""

import numpy as np
import pytest

import mpistrat
from mpistrat import VariableAggregation as Aggregation
from mpistrat import VariableSynchronization as Synchronization
from tests.conftest import all_ranks_agree, raises_on_every_rank


def test_mpistrats_errors_are_tfs_types_too():
    # tf raises RuntimeError where replicas create different variables (testNonMatchingVariableCreation)
    # and AssertionError where their values cannot be regrouped (distribute_utils.regroup)
    assert issubclass(mpistrat.CollectiveMismatchError, (mpistrat.MpistratError))
    assert issubclass(mpistrat.CollectiveMismatchError, ValueError)
    assert issubclass(mpistrat.CollectiveMismatchError, RuntimeError)
    assert issubclass(mpistrat.StructureMismatchError, mpistrat.CollectiveMismatchError)
    assert issubclass(mpistrat.StructureMismatchError, AssertionError)
    assert not issubclass(mpistrat.CollectiveMismatchError, AssertionError)


def test_merge_call_arguments_of_different_structures(group):
    # tf 2.21: merge_call(fn, args=([1.0] * (i + 1),)) from replica i: AssertionError "len(v) == 2,
    # len(v0) == 1" (regroup); with dict keys k0, k1: "v[0].keys: {'k0'}  v[i].keys: {'k1'}"
    s, n = group.strategy, group.size
    if n == 1:
        pytest.skip("needs two replicas to differ")

    def rid():
        return mpistrat.get_replica_context().replica_id_in_sync_group

    for make in (lambda: [np.float32(1)] * (rid() + 1), lambda: {f"k{rid()}": np.float32(1)}):
        raises_on_every_rank(
            group.comm,
            AssertionError,
            lambda make=make: s.run(
                lambda: mpistrat.get_replica_context().merge_call(lambda _, x: 0, args=(make(),))
            ),
            "different structure",
        )


_OTHER = []


def _another():
    if not _OTHER:
        _OTHER.append(mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF))
    return _OTHER[0]


def _set_strategy_in_scope(s):
    with s.scope():
        mpistrat.experimental_set_strategy(_another())


def _mixing_scopes(s):
    with s.scope(), _another().scope():
        pass


def _run_in_run(s):
    s.run(lambda: s.run(lambda: 1))


def _sum_sync_on_read_assign_add(s):
    with s.scope():
        v = mpistrat.Variable(1.0, synchronization=Synchronization.ON_READ, aggregation=Aggregation.SUM)
        v.assign_add(1.0)


def _variable(initial_value=1.0, **kwargs):
    def create(s):
        with s.scope():
            mpistrat.Variable(initial_value, name="v", **kwargs)

    return create


def _colocate_with_plain(s):
    plain = mpistrat.Variable(1.0)
    with s.scope(), s.extended.colocate_vars_with(plain):
        pass


def _per_replica_dataset(s):
    options = mpistrat.InputOptions(experimental_replication_mode=mpistrat.InputReplicationMode.PER_REPLICA)
    with s.scope():
        s.experimental_distribute_dataset([np.arange(4)], options)


def _compute_average_loss_in_cross_replica(s):
    with s.scope():
        mpistrat.compute_average_loss(np.ones(3, np.float32))


def _reduce_max(s):
    with s.scope():
        s.reduce("MAX", np.float32(1.0), axis=None)


def _next_in_replica_fn(s):
    it = iter(s.experimental_distribute_dataset([np.arange(4)]))
    s.run(lambda: next(it))


def _read_none_sync_on_read(s):
    with s.scope():
        v = mpistrat.Variable(1.0, synchronization=Synchronization.ON_READ, aggregation=Aggregation.NONE)
        v.read_value()


CASES = {
    # name: (call, tf's type, tf's words)
    "experimental_set_strategy in a scope": (
        _set_strategy_in_scope,
        RuntimeError,
        "Must not be called inside a `tf.distribute.Strategy` scope.",
    ),
    "another strategy's scope": (
        _mixing_scopes,
        RuntimeError,
        "Mixing different tf.distribute.Strategy objects",
    ),
    "run inside run": (
        _run_in_run,
        RuntimeError,
        "Method requires being in cross-replica context, use get_replica_context().merge_call()",
    ),
    "assign_add to a SUM sync-on-read variable in cross-replica context": (
        _sum_sync_on_read_assign_add,
        ValueError,
        "SyncOnReadVariable does not support `assign_add` in cross-replica context when aggregation is set "
        "to `tf.VariableAggregation.SUM`.",
    ),
    "synchronization NONE in a scope": (
        _variable(synchronization=Synchronization.NONE),
        ValueError,
        "`NONE` variable synchronization mode is not supported with tf.distribute strategy. Please change "
        "the `synchronization` for variable: v",
    ),
    "an invalid synchronization": (
        _variable(synchronization="Invalid"),
        ValueError,
        "Invalid variable synchronization mode: Invalid for variable: v",
    ),
    "an invalid aggregation": (
        _variable(aggregation="invalid"),
        ValueError,
        "Invalid variable aggregation mode: invalid for variable: v",
    ),
    "MEAN of an integer variable": (
        _variable(initial_value=np.int32(1), aggregation=Aggregation.MEAN),
        ValueError,
        "creating distributed tf.Variable with aggregation=MEAN and a non-floating dtype is not supported, "
        "please use a different aggregation or dtype",
    ),
    "colocate_vars_with a variable of no strategy": (
        _colocate_with_plain,
        ValueError,
        "`colocate_vars_with` must only be passed a variable created in this tf.distribute.Strategy.scope(), "
        "not: ",
    ),
    "PER_REPLICA in experimental_distribute_dataset": (
        _per_replica_dataset,
        Exception,  # tf: NotImplementedError; mpistrat: InvalidArgumentError (a ValueError)
        "InputReplicationMode.PER_REPLICA is only supported in `distribute_datasets_from_function`.",
    ),
    "compute_average_loss in cross-replica context": (
        _compute_average_loss_in_cross_replica,
        RuntimeError,
        "You are calling `compute_average_loss` in cross replica context",
    ),
    "an unknown reduce op": (_reduce_max, ValueError, "'MAX' is not a valid ReduceOp"),
    "next(iterator) inside run": (
        _next_in_replica_fn,
        ValueError,
        "next(iterator) should be called from outside of replica_fn. e.g. strategy.run(replica_fn, "
        "args=(next(iterator),))",
    ),
    "reading a NONE sync-on-read variable in cross-replica context": (
        _read_none_sync_on_read,
        ValueError,
        "Could not convert from `tf.VariableAggregation`",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tfs_words_and_type(group, case):
    call, tf_type, words = CASES[case]
    message = raises_on_every_rank(group.comm, tf_type, lambda: call(group.strategy), words)
    all_ranks_agree(group.comm, bool(message))
