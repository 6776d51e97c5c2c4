"""Exactly once, as a property: any dataset length, batch size, rank count and uneven mode.

Hypothesis draws the same examples on every rank (derandomized, no database, no
shrinking), and every assertion is collective over COMM_WORLD, so a failure on one
rank fails them all instead of stranding them. The rank count is drawn too: the
examples run on a strategy over the first ``k`` ranks (the others only check).
The references are written out by hand from the drawn sizes.
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import mpistrat
from mpistrat import InputOptions, InvalidArgumentError
from tests.conftest import RankChecks

WORLD = MPI.COMM_WORLD
MAX_RANKS = 4  # the suite runs at 1 to 4 ranks; draws beyond the world size are clipped

COLLECTIVE = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
    max_examples=40,
)


@pytest.fixture(scope="session")
def prefixes():
    """A strategy over the first k ranks of COMM_WORLD, for every k (None on the ranks outside)."""
    out = {}
    for k in range(1, WORLD.Get_size() + 1):
        comm = WORLD.Split(0 if WORLD.Get_rank() < k else MPI.UNDEFINED, WORLD.Get_rank())
        out[k] = None if comm == MPI.COMM_NULL else mpistrat.MPIStrategy(comm)
    return out


def attempt(fn):
    try:
        return ("ok", fn())
    except InvalidArgumentError as exc:
        return ("error", str(exc))


def by_hand(batch, k):
    """Each replica in rank order takes the next ceil(b / k) examples."""
    per = math.ceil(len(batch) / k)
    return [batch[min(r * per, len(batch)) : min((r + 1) * per, len(batch))] for r in range(k)]


@COLLECTIVE
@given(
    n=st.integers(0, 40),
    batch=st.integers(1, 9),
    k=st.integers(1, MAX_RANKS),
    uneven=st.sampled_from(["pad", "drop", "error"]),
)
def test_split_dataset_sees_every_example_exactly_once(prefixes, n, batch, k, uneven):
    checks = RankChecks()
    k = min(k, WORLD.Get_size())
    strategy = prefixes[k]
    result = None
    if strategy is not None:
        dataset = [np.arange(i, min(i + batch, n)) for i in range(0, n, batch)]
        options = InputOptions(uneven=uneven)
        result = attempt(
            lambda: [x.tolist() for x in strategy.experimental_distribute_dataset(dataset, options)]
        )
    results = WORLD.allgather(result)[:k]

    splits = [by_hand(list(range(i, min(i + batch, n))), k) for i in range(0, n, batch)]
    first_uneven = next((s for s, parts in enumerate(splits) if not all(parts)), None)
    if uneven == "error" and first_uneven is not None:
        checks.that(all(status == "error" and "without data" in got for status, got in results))
    else:
        kept = splits if uneven == "pad" or first_uneven is None else splits[:first_uneven]
        checks.that(
            all(status == "ok" and got == [p[r] for p in kept] for r, (status, got) in enumerate(results))
        )
        if kept is splits:  # nothing dropped: the union is the dataset, each example once
            union = [v for _, got in results for step in got for v in step]
            checks.that(sorted(union) == list(range(n)) and len(union) == n)
    checks.agree(WORLD, f"n={n} batch={batch} k={k} {uneven}: {results}")


@COLLECTIVE
@given(
    sizes=st.lists(st.integers(0, 12), min_size=MAX_RANKS, max_size=MAX_RANKS),
    batches=st.lists(st.integers(1, 4), min_size=MAX_RANKS, max_size=MAX_RANKS),
    k=st.integers(1, MAX_RANKS),
    uneven=st.sampled_from(["pad", "drop", "error"]),
    generator=st.booleans(),
)
def test_pipelines_of_any_length_never_hang_nor_lose_an_example(
    prefixes, sizes, batches, k, uneven, generator
):
    checks = RankChecks()
    k = min(k, WORLD.Get_size())
    strategy = prefixes[k]

    def pipeline(r):
        data = [
            np.arange(j, min(j + batches[r], sizes[r])) + 1000 * r for j in range(0, sizes[r], batches[r])
        ]
        return (b for b in data) if generator else data

    result = None
    if strategy is not None:
        dist = strategy.distribute_datasets_from_function(
            lambda ctx: pipeline(ctx.input_pipeline_id), InputOptions(uneven=uneven)
        )
        result = attempt(lambda: [(x.dtype.str, x.tolist()) for x in dist])
    results = WORLD.allgather(result)[:k]

    steps = [math.ceil(sizes[r] / batches[r]) for r in range(k)]
    expected = [
        [list(range(j, min(j + batches[r], sizes[r]))) for j in range(0, sizes[r], batches[r])]
        for r in range(k)
    ]
    expected = [[[v + 1000 * r for v in b] for b in bs] for r, bs in enumerate(expected)]
    if uneven == "error" and len(set(steps)) > 1:
        checks.that(all(status == "error" and "different lengths" in got for status, got in results))
    else:
        n_steps = min(steps) if uneven == "drop" else max(steps)
        want = [(bs + [[]] * n_steps)[:n_steps] for bs in expected]
        checks.that(
            all(
                status == "ok"
                and [v for _, v in got] == want[r]
                and all(d == np.dtype(np.int64).str for d, _ in got)
                for r, (status, got) in enumerate(results)
            )
        )
        if uneven != "drop":  # every element of every pipeline seen exactly once
            union = [v for _, got in results for _, step in got for v in step]
            everything = [v for bs in expected for b in bs for v in b]
            checks.that(sorted(union) == sorted(everything) and len(union) == len(everything))
    checks.agree(WORLD, f"sizes={sizes[:k]} batches={batches[:k]} {uneven}: {results}")
