"""Ranks that disagree raise CollectiveMismatchError on every rank, naming the leaf and what each passed."""

import numpy as np
import pytest

import mpistrat
from mpistrat import CollectiveMismatchError, CommunicationOptions, UnsupportedTypeError
from mpistrat.collectives.mismatch import by_rank, rank_list
from tests.conftest import Group, all_ranks_agree, raises_on_every_rank


def run_all_reduce(group, op, value, options=None):
    return group.strategy.run(lambda: mpistrat.get_replica_context().all_reduce(op, value, options))


def still_works(group):
    """After an error every rank is at the same point: the next collective gives the right answer."""
    got = run_all_reduce(group, "sum", np.array([group.rank + 1.0]))
    all_ranks_agree(group.comm, got.tolist() == [group.size * (group.size + 1) / 2], f"{got}")


def needs_two(group):
    if group.size < 2:
        pytest.skip("ranks can only disagree with 2 or more ranks")


def test_rank_list_and_by_rank_are_short():
    assert rank_list([4]) == "rank 4"
    assert rank_list([0, 1]) == "ranks 0, 1"
    assert rank_list([0, 1, 2, 3, 7, 9, 10]) == "ranks 0-3, 7, 9, 10"
    assert by_rank(["a", "b", "a", "a"]) == "ranks 0, 2, 3: a; rank 1: b"


def test_different_shapes_name_the_leaf_and_each_ranks_shape(group):
    needs_two(group)
    last = group.size - 1
    value = {"a": np.ones(2), "b": [np.ones(5 if group.rank == last else 3)]}
    message = raises_on_every_rank(
        group.comm, CollectiveMismatchError, lambda: run_all_reduce(group, "sum", value), match="['b'][0]"
    )
    assert f"rank {last}: ['b'][0] float64 shape (5,)" in message
    assert "float64 shape (3,)" in message and "all_reduce (collective #" in message
    still_works(group)


def test_different_dtypes(group):
    needs_two(group)
    value = {"x": np.ones(3, np.float32 if group.rank == 0 else np.float64)}
    message = raises_on_every_rank(
        group.comm, CollectiveMismatchError, lambda: run_all_reduce(group, "sum", value), match="['x']"
    )
    assert "rank 0: ['x'] float32 shape (3,)" in message
    still_works(group)


def test_different_keys(group):
    needs_two(group)
    value = {"a": 1.0, ("z" if group.rank == 1 else "b"): 2.0}
    message = raises_on_every_rank(
        group.comm, CollectiveMismatchError, lambda: run_all_reduce(group, "sum", value), match="['b']"
    )
    assert "rank 1: ['z'] float64" in message
    still_works(group)


def test_list_versus_tuple_is_a_structure_difference(group):
    needs_two(group)
    value = {"a": [1.0, 2.0] if group.rank == 0 else (1.0, 2.0)}
    raises_on_every_rank(
        group.comm,
        CollectiveMismatchError,
        lambda: run_all_reduce(group, "sum", value),
        match="the nest structures differ",
    )
    still_works(group)


def test_different_reduce_ops(group):
    needs_two(group)
    op = "mean" if group.rank == 1 else "sum"
    message = raises_on_every_rank(
        group.comm, CollectiveMismatchError, lambda: run_all_reduce(group, op, 1.0), match="reduce_op"
    )
    assert "rank 1: 'MEAN'" in message
    still_works(group)


def test_all_gather_non_axis_dims_must_agree(group):
    needs_two(group)
    value = {"x": np.ones((group.rank + 1, 2, 4 if group.rank == 1 else 3))}
    message = raises_on_every_rank(
        group.comm,
        CollectiveMismatchError,
        lambda: group.strategy.run(lambda: mpistrat.get_replica_context().all_gather(value, axis=0)),
        match="['x']",
    )
    assert "rank 1: ['x'] float64 shape (*, 2, 4)" in message and "all dims but axis" in message
    still_works(group)


def test_all_gather_uneven_axis_is_not_a_mismatch(group):
    value = {"x": np.full((group.rank + 1, 2), float(group.rank))}
    got = group.strategy.run(lambda: mpistrat.get_replica_context().all_gather(value, axis=0))
    expected = np.concatenate([np.full((r + 1, 2), float(r)) for r in range(group.size)])
    all_ranks_agree(group.comm, np.array_equal(got["x"], expected), f"{got}")


def test_different_collectives_raise_instead_of_exchanging_garbage(group):
    needs_two(group)

    def step():
        ctx = mpistrat.get_replica_context()
        return ctx.all_gather(np.ones(2), axis=0) if group.rank == 0 else ctx.all_reduce("sum", np.ones(2))

    message = raises_on_every_rank(
        group.comm, CollectiveMismatchError, lambda: group.strategy.run(step), match="different collectives"
    )
    assert "rank 0: all_gather" in message and "all_reduce" in message
    still_works(group)


def test_merge_call_against_all_reduce(group):
    needs_two(group)

    def step():
        ctx = mpistrat.get_replica_context()
        if group.rank == 0:
            return ctx.merge_call(lambda strategy: None)
        return ctx.all_reduce("sum", 1.0)

    raises_on_every_rank(
        group.comm, CollectiveMismatchError, lambda: group.strategy.run(step), match="rank 0: merge_call"
    )
    still_works(group)


def test_bad_input_on_one_rank_fails_every_rank_with_its_type(group):
    value = {"a": np.ones(2), "b": "oops" if group.rank == group.size - 1 else np.ones(2)}
    message = raises_on_every_rank(
        group.comm, UnsupportedTypeError, lambda: run_all_reduce(group, "sum", value), match="['b']"
    )
    assert f"failed on rank {group.size - 1}" in message
    still_works(group)


def test_mismatch_is_a_value_error():
    assert issubclass(CollectiveMismatchError, ValueError)


def test_check_off_keeps_results_right(group, monkeypatch):
    value = {"a": np.arange(3.0), "b": [np.int32(group.rank)]}
    expected = {"a": np.arange(3.0) * group.size, "b": [sum(range(group.size))]}
    monkeypatch.setenv("MPISTRAT_CHECK", "0")  # read when a strategy is created
    unchecked = Group(group.name, group.comm, mpistrat.MPIStrategy(group.comm))
    monkeypatch.delenv("MPISTRAT_CHECK")
    assert unchecked.strategy.extended.collectives.check == 0
    for where, options in ((group, CommunicationOptions(check=False)), (unchecked, None)):
        got = run_all_reduce(where, "sum", value, options)
        ok = np.array_equal(got["a"], expected["a"]) and int(got["b"][0]) == expected["b"][0]
        all_ranks_agree(group.comm, ok, f"{got}")
    unchecked.strategy.experimental_finalize()
    still_works(group)


def test_check_off_still_counts_collectives(group):
    collectives = group.strategy.extended.collectives
    before = collectives.seq
    run_all_reduce(group, "sum", 1.0, CommunicationOptions(check=False))
    run_all_reduce(group, "sum", 1.0)
    closing = 2 * (group.size > 1)  # each strategy.run's closing handshake (the strategy's check is on)
    assert collectives.seq == before + 2 + closing
