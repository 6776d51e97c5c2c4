"""distribute_datasets_from_function: one pipeline per rank, of any length, and no hang.

Rank r's pipeline holds the examples ``r * 1000 + j``, so the union of what every
rank saw can be compared with the examples every pipeline held, by hand.
"""

import numpy as np
import pytest

import mpistrat
from mpistrat import (
    CollectiveMismatchError,
    CommunicationOptions,
    ContextError,
    InputOptions,
    InvalidArgumentError,
)
from tests.conftest import RankChecks, all_ranks_agree, raises_on_every_rank
from tests.support.counting import CountingComm, Ledger


def pipeline(rank, num_batches, batch=2, dtype=np.int64):
    return [np.arange(batch, dtype=dtype) + rank * 1000 + batch * b for b in range(num_batches)]


def lengths_for(size):
    """Rank r has r + 1 batches: every rank count gives pipelines of different lengths."""
    return [r + 1 for r in range(size)]


def run_epoch(strategy, lengths, options=None):
    dist = strategy.distribute_datasets_from_function(
        lambda ctx: (b for b in pipeline(ctx.input_pipeline_id, lengths[ctx.input_pipeline_id])), options
    )
    return [x for x in dist]


def test_input_context_is_this_rank(group):
    seen = []

    def dataset_fn(ctx):
        seen.append(ctx)
        return [np.arange(ctx.get_per_replica_batch_size(4 * group.size))]

    got = list(group.strategy.distribute_datasets_from_function(dataset_fn))
    ctx = seen[0] if len(seen) == 1 else None
    ok = ctx is not None and (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (
        group.size,
        group.rank,
        group.size,
    )
    all_ranks_agree(group.comm, ok and [x.tolist() for x in got] == [[0, 1, 2, 3]], f"{seen} {got}")


def test_pad_keeps_going_until_every_pipeline_ends(group):
    lengths = lengths_for(group.size)
    got = run_epoch(group.strategy, lengths)
    mine = pipeline(group.rank, lengths[group.rank])
    padded = [np.empty(0, np.int64)] * (max(lengths) - lengths[group.rank])
    ok = len(got) == max(lengths) and all(
        g.dtype == w.dtype and np.array_equal(g, w) for g, w in zip(got, mine + padded, strict=True)
    )
    seen = sorted(v for part in group.comm.allgather([v for x in got for v in x.tolist()]) for v in part)
    want = sorted(v for r in range(group.size) for b in pipeline(r, lengths[r]) for v in b.tolist())
    all_ranks_agree(group.comm, ok and seen == want, f"{got}")


def test_drop_ends_with_the_shortest_pipeline(group):
    lengths = lengths_for(group.size)
    got = run_epoch(group.strategy, lengths, InputOptions(uneven="drop"))
    want = pipeline(group.rank, min(lengths))
    ok = len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want, strict=False))
    all_ranks_agree(group.comm, ok, f"{got}")


def test_error_names_the_ranks_and_their_counts(group):
    lengths = lengths_for(group.size)
    if group.size == 1:
        all_ranks_agree(
            group.comm, len(run_epoch(group.strategy, lengths, InputOptions(uneven="error"))) == 1
        )
        return
    message = raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: run_epoch(group.strategy, lengths, InputOptions(uneven="error")),
        "different lengths",
    )
    # At step 2 rank 0 (1 batch) has run out; every other rank has read 2 batches (4 examples).
    counts = ", ".join(f"rank {r}: {1 if r == 0 else 2} ({2 if r == 0 else 4})" for r in range(group.size))
    ok = "ranks [0] ran out of data at step 2" in message and counts in message
    all_ranks_agree(group.comm, ok, message)


@pytest.mark.parametrize("uneven", ["pad", "drop", "error"])
def test_equal_lengths_are_never_uneven(group, uneven):
    got = run_epoch(group.strategy, [3] * group.size, InputOptions(uneven=uneven))
    want = pipeline(group.rank, 3)
    all_ranks_agree(group.comm, all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)), f"{got}")


def test_empty_pipelines(group):
    nothing = run_epoch(group.strategy, [0] * group.size)
    # Only the last rank has data: the others learn the element spec from it for their empty batches.
    lengths = [0] * (group.size - 1) + [2]
    got = run_epoch(group.strategy, lengths)
    checks = RankChecks()
    checks.that(nothing == [] and len(got) == 2)
    checks.that(
        all(x.dtype == np.int64 and x.shape == ((2,) if group.rank == group.size - 1 else (0,)) for x in got)
    )
    checks.agree(group.comm, f"{nothing} {got}")


def test_nested_elements_and_element_spec(group):
    def dataset_fn(ctx):
        n = ctx.input_pipeline_id + 1
        return [
            {"x": np.ones((2, 3), np.float32) * r, "y": {"label": np.arange(2, dtype=np.int32)}}
            for r in range(n)
        ]

    dist = group.strategy.distribute_datasets_from_function(dataset_fn)
    before = dist.element_spec  # no communication: this rank's first batch
    it = iter(dist)
    batches = list(it)
    want_spec = {
        "x": mpistrat.ArraySpec((None, 3), np.dtype(np.float32)),
        "y": {"label": mpistrat.ArraySpec((None,), np.dtype(np.int32))},
    }
    pads = batches[group.rank + 1 :]
    checks = RankChecks()
    checks.that(before == want_spec and dist.element_spec == want_spec and it.element_spec == want_spec)
    checks.that(len(batches) == group.size and len(batches[0]["x"]) == 2)
    checks.that(all(p["x"].shape == (0, 3) and p["y"]["label"].dtype == np.int32 for p in pads))
    checks.agree(group.comm, f"{before} {batches}")


def test_get_next_as_optional_agrees_on_the_end(group):
    lengths = lengths_for(group.size)
    it = iter(
        group.strategy.distribute_datasets_from_function(
            lambda ctx: pipeline(ctx.input_pipeline_id, lengths[ctx.input_pipeline_id])
        )
    )
    flags = []
    while True:
        opt = it.get_next_as_optional()
        flags.append(opt.has_value())
        if not opt.has_value():
            break
    all_ranks_agree(group.comm, flags == [True] * max(lengths) + [False], f"{flags}")


def test_make_input_fn_iterator(group):
    lengths = lengths_for(group.size)
    iterator = group.strategy.make_input_fn_iterator(
        lambda ctx: pipeline(ctx.input_pipeline_id, lengths[ctx.input_pipeline_id])
    )
    assert iterator.initialize() == []
    first = iterator.get_next()
    rest = list(iterator)
    iterator.initialize()  # a list pipeline starts over
    again = iterator.get_next()
    want = pipeline(group.rank, 1)[0]
    ok = np.array_equal(first, want) and np.array_equal(again, want) and len(rest) == max(lengths) - 1
    all_ranks_agree(group.comm, ok, f"{first} {rest} {again}")
    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: group.strategy.make_input_fn_iterator(lambda c: [], "PER_HOST"),
        "PER_HOST",
    )


def test_alias_and_per_replica_mode(group):
    options = InputOptions(experimental_replication_mode=mpistrat.InputReplicationMode.PER_REPLICA)
    dist = group.strategy.experimental_distribute_datasets_from_function(
        lambda ctx: pipeline(ctx.input_pipeline_id, 1), options
    )
    got = list(dist)
    all_ranks_agree(
        group.comm, len(got) == 1 and np.array_equal(got[0], pipeline(group.rank, 1)[0]), f"{got}"
    )


def test_failures_on_one_rank_are_raised_on_every_rank(group):
    last = group.size - 1

    def bad_fn(ctx):
        if ctx.input_pipeline_id == last:
            raise KeyError("no shard")
        return []

    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: group.strategy.distribute_datasets_from_function(bad_fn),
        "no shard",
    )

    def flaky(ctx):
        yield np.arange(2)
        if ctx.input_pipeline_id == last:
            raise OSError("disk gone")
        yield np.arange(2)

    dist = group.strategy.distribute_datasets_from_function(flaky)
    raises_on_every_rank(group.comm, InvalidArgumentError, lambda: list(dist), "disk gone")


def test_pipelines_that_yield_different_dtypes_raise_everywhere(group):
    def dataset_fn(ctx):
        yield np.arange(2)
        yield np.arange(2, dtype=np.float32 if ctx.input_pipeline_id == group.size - 1 else np.int64)

    if group.size == 1:
        return
    first = group.strategy.distribute_datasets_from_function(
        lambda ctx: [np.arange(2, dtype=np.float32 if ctx.input_pipeline_id else np.int64)]
    )
    raises_on_every_rank(group.comm, CollectiveMismatchError, lambda: list(first), "different elements")
    later = group.strategy.distribute_datasets_from_function(dataset_fn)
    raises_on_every_rank(group.comm, CollectiveMismatchError, lambda: list(later), "disagree at step 2")


def test_agreement_holds_with_checking_off(group):
    strategy = mpistrat.MPIStrategy(group.comm, communication_options=CommunicationOptions(check=False))
    try:
        lengths = lengths_for(group.size)
        got = run_epoch(strategy, lengths)
        split = list(strategy.experimental_distribute_dataset([np.arange(2 * group.size)]))
        ok = len(got) == max(lengths) and [x.tolist() for x in split] == [
            [2 * group.rank, 2 * group.rank + 1]
        ]
        all_ranks_agree(group.comm, ok, f"{got} {split}")
    finally:
        strategy.experimental_finalize()


def test_not_inside_a_merge_fn_or_run(group):
    strategy = group.strategy
    dist = strategy.distribute_datasets_from_function(lambda ctx: pipeline(ctx.input_pipeline_id, 2))
    it = iter(dist)

    def merge_fn(strategy):
        return it.get_next()

    raises_on_every_rank(
        group.comm,
        ContextError,
        lambda: strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn)),
        "merge_fn",
    )
    raises_on_every_rank(
        group.comm,
        ContextError,
        lambda: strategy.run(lambda: strategy.distribute_datasets_from_function(lambda c: [])),
        "cross-replica",
    )


def test_sharded_shuffled_arrays_partition_the_data(group):
    data = np.arange(31)

    def dataset_fn(ctx):
        ds = mpistrat.ArrayDataset(data, batch_size=4, shuffle=True, seed=7)
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)

    dist = group.strategy.distribute_datasets_from_function(dataset_fn)
    seen = [
        sorted(v for part in group.comm.allgather([v for x in dist for v in x.tolist()]) for v in part)
        for _ in range(2)
    ]
    all_ranks_agree(group.comm, seen == [list(range(31))] * 2, f"{seen}")


@pytest.mark.parametrize("check", [True, False])
def test_a_pipeline_step_costs_one_handshake_and_the_counts_travel_once_at_the_end(group, check):
    """Whether a pipeline ran out rides in the step's handshake, even with the check off: per step a
    rank moves the same bytes at any R; the per-rank counts (an Allgather) come once, at the end."""
    strategy = mpistrat.MPIStrategy(
        CountingComm(group.comm), communication_options=mpistrat.CommunicationOptions(check=check)
    )
    steps = 5
    dist = strategy.distribute_datasets_from_function(lambda ctx: pipeline(ctx.input_pipeline_id, steps))
    iterator = iter(dist)
    next(iterator)  # the first step agrees on the element spec too
    with Ledger.recording() as ledger:
        for _ in range(steps - 1):
            next(iterator)
    with Ledger.recording() as end:
        assert next(iterator, None) is None
    handshake = 2 * 13 * 8  # thirteen int64 in and out
    checks = RankChecks()
    checks.that(ledger.names() == ["Allreduce"] * (steps - 1) and ledger.moved == (steps - 1) * handshake)
    checks.that(end.names() == ["Allreduce", "Allreduce", "Allgather"])  # the step, then the counts
    checks.agree(group.comm, f"R={group.size}: steps {ledger.log}; end {end.log}")
    strategy.experimental_finalize()
