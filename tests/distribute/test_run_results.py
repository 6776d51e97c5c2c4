"""What ``strategy.run`` does with results whose structures differ between replicas, as tf's regroup.

tf.distribute regroups the replicas' results into ``PerReplica`` values (``distribute_utils.regroup``)
and asserts where replica 0's result holds a list, tuple or mapping and another replica's holds
something else there. Each case's expected outcome is tf 2.21's, on a ``MirroredStrategy`` over
2 CPU devices (replica ``i`` returning the value below for ``r = i``): ``AssertionError``, or a
``PerReplica`` of each replica's own value. Here every rank keeps its own result, and raises on every
rank where tf raises (``StructureMismatchError``, an ``AssertionError``).
"""

import collections

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat
from tests.conftest import all_ranks_agree, raises_on_every_rank

Pair = collections.namedtuple("Pair", "a b")
ONE = np.float32(1.0)

CASES = {
    # name: (replica r's result, whether tf 2.21 raises AssertionError)
    "list lengths": (lambda r: [ONE] * (r + 1), True),  # "len(v) == 2, len(v0) == 1"
    "dict keys": (lambda r: {f"k{r}": ONE}, True),  # "v[0].keys: {'k0'}  v[i].keys: {'k1'}"
    "tuple and list": (lambda r: [(ONE,), [ONE]][r % 2], True),
    "dict and list": (lambda r: [{"a": ONE}, [ONE]][r % 2], True),
    "a list on replica 0, a leaf on others": (lambda r: [ONE] if r == 0 else ONE, True),
    "lengths inside a dict": (lambda r: {"a": [ONE] * (r + 1)}, True),
    "a leaf on replica 0, a list on others": (lambda r: ONE if r == 0 else [ONE], False),
    "None and a value": (lambda r: [None, ONE][r % 2], False),
    "namedtuple and tuple": (lambda r: [Pair(ONE, ONE), (ONE, ONE)][r % 2], False),
    "dict and OrderedDict": (
        lambda r: [{"a": ONE, "b": ONE}, collections.OrderedDict([("b", ONE), ("a", ONE)])][r % 2],
        False,
    ),
    "shapes": (lambda r: np.zeros(r + 1, np.float32), False),
    "dtypes": (lambda r: np.zeros(1, [np.float32, np.int32][r % 2]), False),
    "values": (lambda r: {"loss": np.float32(r)}, False),
}


def _replica_id():
    return mpistrat.get_replica_context().replica_id_in_sync_group


@pytest.mark.parametrize("case", list(CASES))
def test_results_that_differ_between_replicas(group, case):
    s, n, r = group.strategy, group.size, group.rank
    make, tf_raises = CASES[case]
    if tf_raises and n > 1:
        message = raises_on_every_rank(
            group.comm, AssertionError, lambda: s.run(lambda: make(_replica_id())), "same nest structure"
        )
        all_ranks_agree(group.comm, "strategy.run's result structured" in message, message)
        return
    got = s.run(lambda: make(_replica_id()))
    want = make(r)
    same = mpistrat.nest.map_structure(lambda a, b: type(a) is type(b) and np.array_equal(a, b), got, want)
    all_ranks_agree(group.comm, type(got) is type(want) and all(mpistrat.nest.flatten(same)), f"{got!r}")


@pytest.mark.parametrize("case", [name for name, (_, raises) in CASES.items() if raises])
def test_a_structure_that_changes_on_some_replicas_after_steps_alike_raises(group, case):
    """Steps whose results are structured alike on every rank (remembered from step to step), then
    a step where they differ: the same error as in a first step."""
    if group.size == 1:
        pytest.skip("needs two replicas to differ")
    s = group.strategy
    make = CASES[case][0]
    for _ in range(3):
        s.run(lambda: make(0))
    raises_on_every_rank(group.comm, AssertionError, lambda: s.run(lambda: make(_replica_id())), "same nest")


def test_the_error_is_catchable_as_mpistrats_and_tfs_types(group):
    if group.size == 1:
        pytest.skip("needs two replicas to differ")
    for error in (mpistrat.StructureMismatchError, mpistrat.CollectiveMismatchError, AssertionError):
        raises_on_every_rank(
            group.comm, error, lambda: group.strategy.run(lambda: [ONE] * (_replica_id() + 1))
        )
    after = group.strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", ONE))
    all_ranks_agree(group.comm, after == group.size, f"{after}")


def test_an_exception_on_one_replica_reaches_every_rank(group):
    # tf raises a replica's exception from strategy.run: here the rank that raised it raises it as
    # it was; the others raise its type with its message, instead of going on without it
    s, n = group.strategy, group.size

    def fn():
        if _replica_id() == n - 1:
            raise KeyError("boom on the last replica")
        return ONE

    message = raises_on_every_rank(group.comm, KeyError, lambda: s.run(fn), "boom on the last replica")
    if group.rank != n - 1:
        all_ranks_agree(group.comm, f"failed on rank {n - 1}" in message, message)
    else:
        all_ranks_agree(group.comm, True)
    after = s.run(lambda: mpistrat.get_replica_context().all_reduce("sum", ONE))
    all_ranks_agree(group.comm, after == n, f"{after}")


def test_a_collective_that_failed_inside_fn_is_not_waited_for(group):
    # A rank that raises early meets the others in their all_reduce: that handshake fails on every rank,
    # and no rank then waits in the closing one
    s, n = group.strategy, group.size
    if n == 1:
        pytest.skip("needs two replicas to differ")

    def fn():
        if _replica_id() == 0:
            raise ValueError("early")
        return mpistrat.get_replica_context().all_reduce("sum", ONE)

    raises_on_every_rank(group.comm, ValueError, lambda: s.run(fn))
    after = s.run(lambda: mpistrat.get_replica_context().all_reduce("sum", ONE))
    all_ranks_agree(group.comm, after == n, f"{after}")


@pytest.mark.usefixtures("step_twin")
@pytest.mark.parametrize("case", ["list lengths", "dict keys", "a leaf on replica 0, a list on others"])
def test_under_step_a_learned_steps_closing_compares_the_results_as_tf(case):
    """Under ``MPISTRAT_CHECK=step`` a step after the first closes with one handshake when it left a
    collective unchecked: that handshake carries the result's structure too, so a structure tf
    rejects raises on every rank there, and one tf regroups is each rank's own result, as with
    the check on. Steps alike first, so the step that differs is one of the learned ones. Under
    each twin of the step check (the compiled one closes compiled)."""
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("needs two replicas to differ")
    make, tf_raises = CASES[case]
    options = mpistrat.CommunicationOptions(check="step")
    strategy = mpistrat.MPIStrategy(world, communication_options=options)

    def step(differ):
        total = mpistrat.get_replica_context().all_reduce("sum", ONE)  # left unchecked once learned
        return total, make(_replica_id() if differ else 0)

    for _ in range(3):
        strategy.run(step, args=(False,))
    learned = not strategy.extended.collectives.step_check.learning
    if tf_raises:
        message = raises_on_every_rank(
            world, AssertionError, lambda: strategy.run(step, args=(True,)), "same nest"
        )
        ok = learned
    else:
        total, got = strategy.run(step, args=(True,))
        message = f"{total!r} {got!r}"
        ok = learned and total == world.Get_size() and type(got) is type(make(world.Get_rank()))
    after = strategy.run(step, args=(False,))[0]  # the ranks go on together
    strategy.experimental_finalize()
    all_ranks_agree(world, ok and after == world.Get_size(), message)
