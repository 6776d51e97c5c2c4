"""experimental_distribute_dataset: every global batch split across replicas the way tf.distribute splits it.

The references are plain loops over the global batches (each replica in rank order
takes the next ceil(b / R) examples), or, for three replicas, the issue's literal steps.
"""

import math

import numpy as np
import pytest

import mpistrat
from mpistrat import CollectiveMismatchError, ContextError, InputOptions, InvalidArgumentError
from tests.conftest import RankChecks, all_ranks_agree, raises_on_every_rank


def batches_of(n, batch, dtype=np.int64):
    return [np.arange(i, min(i + batch, n), dtype=dtype) for i in range(0, n, batch)]


def reference_split(global_batch, size):
    """Replica r's part of each global batch, by hand."""
    per = math.ceil(len(global_batch) / size)
    parts, taken = [], 0
    for _ in range(size):
        take = min(per, len(global_batch) - taken)
        parts.append(list(global_batch[taken : taken + take]))
        taken += take
    return parts


def read_all(strategy, dataset, options=None):
    return [x for x in strategy.experimental_distribute_dataset(dataset, options)]


def test_issue_example_range_10_in_batches_of_4(group):
    got = [x.tolist() for x in read_all(group.strategy, batches_of(10, 4))]
    want = [reference_split(list(b), group.size)[group.rank] for b in batches_of(10, 4)]
    checks = RankChecks()
    checks.that(got == want)
    if group.size == 3:  # the issue's steps: [[0,1],[2,3],[]], [[4,5],[6,7],[]], [[8],[9],[]]
        checks.that(got == [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [9]], [[], [], []]][group.rank])
    checks.agree(group.comm, f"{got} != {want}")


def test_empty_replicas_get_empty_batches_of_the_right_dtype(group):
    got = read_all(group.strategy, batches_of(2, 2, np.float32))
    want = reference_split([0.0, 1.0], group.size)[group.rank]
    x = got[0] if len(got) == 1 else None
    ok = x is not None and x.dtype == np.float32 and x.shape == (len(want),) and x.tolist() == want
    all_ranks_agree(group.comm, ok, f"{got} != {want}")


@pytest.mark.parametrize("n", [0, 1, 2, 7, 13])
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_every_example_seen_exactly_once(group, n, batch):
    seen = [v for x in read_all(group.strategy, batches_of(n, batch)) for v in x.tolist()]
    everyone = sorted(v for part in group.comm.allgather(seen) for v in part)
    steps = len(read_all(group.strategy, batches_of(n, batch)))
    all_ranks_agree(
        group.comm, everyone == list(range(n)) and steps == math.ceil(n / batch), f"{everyone} {steps}"
    )


def test_nested_elements(group):
    checks = RankChecks()
    n, batch = 7, 3
    xs = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    ys = np.arange(n, dtype=np.int32)
    dataset = [{"x": xs[i : i + batch], "y": ys[i : i + batch]} for i in range(0, n, batch)]
    got = read_all(group.strategy, dataset)
    checks.that(len(got) == 3)
    detail = ""
    for step, (g, b) in enumerate(zip(got, dataset, strict=False)):
        want_y = reference_split(list(b["y"]), group.size)[group.rank]
        start = want_y[0] - 3 * step if want_y else 0
        want_x = b["x"][start : start + len(want_y)]
        checks.that(set(g) == {"x", "y"} and g["y"].tolist() == want_y and g["y"].dtype == np.int32)
        checks.that(  # g["x"] once g is known to have it
            set(g) == {"x", "y"}
            and g["x"].shape == (len(want_y), 2)
            and g["x"].dtype == np.float32
            and np.array_equal(g["x"], want_x)
        )
        detail += f"step {step}: {g} "
    checks.agree(group.comm, detail)


def test_generator_dataset_and_element_spec_peek(group):
    def gen():
        yield from batches_of(5, 4)

    dist = group.strategy.experimental_distribute_dataset(gen())
    spec = dist.element_spec
    seen = [v for x in dist for v in x.tolist()]
    everyone = sorted(v for part in group.comm.allgather(seen) for v in part)
    checks = RankChecks()
    checks.that(spec == mpistrat.ArraySpec((None,), np.dtype(np.int64)) and everyone == list(range(5)))
    checks.that([x for x in dist] == [])  # a generator is read once
    checks.agree(group.comm, f"{spec} {everyone}")


def test_iterating_a_list_twice_gives_two_epochs(group):
    dist = group.strategy.experimental_distribute_dataset(batches_of(6, 6))
    first = [x.tolist() for x in dist]
    second = [x.tolist() for x in dist]
    all_ranks_agree(group.comm, first == second and len(first) == 1, f"{first} {second}")


def test_get_next_and_optional(group):
    it = iter(group.strategy.experimental_distribute_dataset(batches_of(8, 4)))
    a = it.get_next()
    opt = it.get_next_as_optional()
    end = it.get_next_as_optional()
    try:
        it.get_next()
        stopped = False
    except StopIteration:
        stopped = True
    want = [reference_split(list(range(i, i + 4)), group.size)[group.rank] for i in (0, 4)]
    checks = RankChecks()
    checks.that(a.tolist() == want[0] and opt.has_value() and opt.get_value().tolist() == want[1])
    checks.that(not end.has_value() and stopped and opt.element_spec == it.element_spec)
    checks.agree(group.comm, f"{a} {opt} {end}")
    raises_on_every_rank(group.comm, InvalidArgumentError, end.get_value, "has no value")


@pytest.mark.parametrize("uneven", ["pad", "drop", "error"])
def test_uneven_options_for_a_short_last_batch(group, uneven):
    # 9 examples in batches of 4: the last batch (1 example) leaves replicas 1.. empty when R > 1,
    # and with R = 3 every batch leaves replica 2 empty (4 = 2 + 2 + 0).
    options = InputOptions(uneven=uneven)
    splits = [reference_split(list(b), group.size) for b in batches_of(9, 4)]
    if group.size == 1 or uneven == "pad":
        got = [x.tolist() for x in read_all(group.strategy, batches_of(9, 4), options)]
        all_ranks_agree(group.comm, got == [s[group.rank] for s in splits], f"{got}")
    elif uneven == "drop":
        got = [x.tolist() for x in read_all(group.strategy, batches_of(9, 4), options)]
        kept = splits[: next(i for i, s in enumerate(splits) if not all(s))]
        want = [s[group.rank] for s in kept]
        all_ranks_agree(group.comm, got == want and len(kept) == (2 if group.size in (2, 4) else 0), f"{got}")
    else:
        message = raises_on_every_rank(
            group.comm,
            InvalidArgumentError,
            lambda: read_all(group.strategy, batches_of(9, 4), options),
            "uneven",
        )
        first = next(s for s in splits if not all(s))
        empty = [r for r, part in enumerate(first) if not part]
        all_ranks_agree(group.comm, f"replicas {empty} of {group.size} without data" in message, message)


def test_make_dataset_iterator_initialize_and_get_next(group):
    iterator = group.strategy.make_dataset_iterator(batches_of(6, 3))
    assert iterator.initialize() == []
    first = [iterator.get_next().tolist(), iterator.get_next().tolist()]
    try:
        iterator.get_next()
        stopped = False
    except StopIteration:
        stopped = True
    iterator.initialize()
    again = iterator.get_next().tolist()
    want = [reference_split(list(b), group.size)[group.rank] for b in batches_of(6, 3)]
    all_ranks_agree(group.comm, first == want and stopped and again == want[0], f"{first} {again}")


def test_run_consumes_distributed_batches(group):
    def step(x):
        return mpistrat.get_replica_context().all_reduce("sum", x.sum())

    totals = [
        group.strategy.run(step, args=(x,))
        for x in group.strategy.experimental_distribute_dataset(batches_of(10, 4))
    ]
    all_ranks_agree(group.comm, [int(t) for t in totals] == [6, 22, 17], f"{totals}")


def test_batches_that_differ_between_ranks_raise_everywhere(world):
    if world.size == 1:
        pytest.skip("needs ranks that can disagree")
    n = 8 if world.rank == 0 else 4  # rank 0 has a batch more than the others
    message = raises_on_every_rank(
        world.comm,
        CollectiveMismatchError,
        lambda: read_all(world.strategy, batches_of(n, 4)),
        "different global",
    )
    all_ranks_agree(world.comm, "end of data" in message, message)


def test_a_dataset_error_on_one_rank_is_raised_on_every_rank(group):
    def gen():
        yield np.arange(4)
        if group.rank == group.size - 1:
            raise OSError("disk gone")
        yield np.arange(4)

    raises_on_every_rank(
        group.comm, InvalidArgumentError, lambda: read_all(group.strategy, gen()), "disk gone"
    )


def test_bad_batches_are_refused_clearly(group):
    ragged = [{"a": np.arange(3), "b": np.arange(2)}]
    raises_on_every_rank(
        group.comm, InvalidArgumentError, lambda: read_all(group.strategy, ragged), "leading"
    )
    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: group.strategy.experimental_distribute_dataset(3),
        "iterable",
    )


def test_contexts(group):
    strategy = group.strategy
    raises_on_every_rank(
        group.comm,
        ContextError,
        lambda: strategy.run(lambda: strategy.experimental_distribute_dataset([np.arange(2)])),
        "cross-replica",
    )
    with strategy.scope():
        got = [x.tolist() for x in strategy.experimental_distribute_dataset([np.arange(group.size)])]
    all_ranks_agree(group.comm, got == [[group.rank]], f"{got}")
    options = InputOptions(experimental_replication_mode=mpistrat.InputReplicationMode.PER_REPLICA)
    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: strategy.experimental_distribute_dataset([np.arange(2)], options),
        "PER_REPLICA",
    )


def test_shuffled_array_dataset_stays_a_partition(group):
    data = {"x": np.arange(23) * 10, "i": np.arange(23)}
    dataset = mpistrat.ArrayDataset(data, batch_size=5, shuffle=True, seed=1234)
    dist = group.strategy.experimental_distribute_dataset(dataset)
    epochs = []
    for _ in range(2):
        seen = [(int(i), int(x)) for b in dist for i, x in zip(b["i"], b["x"], strict=True)]
        epochs.append(sorted(p for part in group.comm.allgather(seen) for p in part))
        epochs.append([p for part in group.comm.allgather(seen) for p in part])
    want = [(i, 10 * i) for i in range(23)]
    ok = epochs[0] == want and epochs[2] == want and epochs[1] != epochs[3]  # a new order each epoch
    all_ranks_agree(group.comm, ok, f"{epochs}")


def test_distribute_values_from_function(group):
    strategy = group.strategy
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(2, ctx.replica_id_in_sync_group * 10 + ctx.num_replicas_in_sync)
    )
    got = strategy.run(lambda v: mpistrat.get_replica_context().all_reduce("sum", v), args=(value,))
    want = sum(r * 10 + group.size for r in range(group.size))
    all_ranks_agree(group.comm, got.tolist() == [want, want], f"{got}")


def test_input_options_and_contexts_validate():
    with pytest.raises(InvalidArgumentError, match="uneven"):
        InputOptions(uneven="truncate")
    with pytest.raises(InvalidArgumentError, match="replication_mode"):
        InputOptions(experimental_replication_mode="PER_HOST")
    ctx = mpistrat.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(64) == 16
    with pytest.raises(InvalidArgumentError, match="not divisible"):
        ctx.get_per_replica_batch_size(10)
    with pytest.raises(InvalidArgumentError, match="input_pipeline_id"):
        mpistrat.InputContext(num_input_pipelines=2, input_pipeline_id=2)
    assert mpistrat.ValueContext(1, 2).replica_id_in_sync_group == 1
    with pytest.raises(InvalidArgumentError, match="replica_id_in_sync_group"):
        mpistrat.ValueContext(2, 2)
