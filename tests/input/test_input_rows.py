"""experimental_distribute_dataset over an ArrayDataset: each rank gathers only its own rows.

The references are plain NumPy: the documented shuffle
``np.random.default_rng([seed, pass]).permutation(n)``, then every ``num_shards``-th
example from ``shard_index``, batches of ``batch_size``, and replica r's part of a
global batch of b examples is ``[r * ceil(b / R), (r + 1) * ceil(b / R))`` clipped to b.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat
from mpistrat import ArrayDataset, CollectiveMismatchError, InputOptions, InvalidArgumentError
from tests.conftest import RankChecks, all_ranks_agree, raises_on_every_rank
from tests.support.counting import CountingComm, Ledger

N = 23

# (ArrayDataset keywords, shard (num_shards, index) or None)
CASES = {
    "plain": ({"batch_size": 6}, None),  # views, no gathering: unchanged, here as a control
    "shuffled": ({"batch_size": 5, "shuffle": True, "seed": 11}, None),
    "shuffled-drop-remainder": ({"batch_size": 5, "shuffle": True, "seed": 3, "drop_remainder": True}, None),
    "sharded": ({"batch_size": 4}, (2, 1)),
    "shuffled-sharded": ({"batch_size": 3, "shuffle": True, "seed": 5}, (3, 0)),
    "short-batches": ({"batch_size": 2, "shuffle": True, "seed": 8}, None),
}


def make_data(n: int = N) -> dict[str, Any]:
    return {
        "x": np.arange(3 * n, dtype=np.float32).reshape(n, 3) / 4,
        "meta": {"y": (np.arange(n, dtype=np.int32) * 7) % 5, "i": np.arange(n, dtype=np.int64)},
    }


def make_dataset(data: dict[str, Any], kwargs: dict[str, Any], shard: tuple[int, int] | None) -> ArrayDataset:
    ds = ArrayDataset(data, **kwargs)
    return ds if shard is None else ds.shard(*shard)


def reference_orders(n: int, kwargs: dict[str, Any], shard: tuple[int, int] | None, epoch: int) -> list:
    """The example indices of each global batch of pass ``epoch``."""
    order = np.arange(n)
    if kwargs.get("shuffle"):
        order = np.random.default_rng([kwargs.get("seed", 0), epoch]).permutation(n)
    if shard is not None:
        order = order[shard[1] :: shard[0]]
    size = kwargs["batch_size"]
    batches = [order[i : i + size] for i in range(0, len(order), size)]
    if kwargs.get("drop_remainder") and batches and len(batches[-1]) < size:
        batches.pop()
    return batches


def take(data: dict[str, Any], rows: Any) -> dict[str, Any]:
    return {"x": data["x"][rows], "meta": {"y": data["meta"]["y"][rows], "i": data["meta"]["i"][rows]}}


def cut(batch: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    return {"x": batch["x"][start:stop], "meta": {k: v[start:stop] for k, v in batch["meta"].items()}}


def replica_slice(b: int, size: int, rank: int) -> tuple[int, int]:
    per = math.ceil(b / size) if b else 0
    start = min(rank * per, b)
    return start, min(start + per, b)


def reference_epoch(
    data: dict[str, Any], kwargs: dict[str, Any], shard: Any, epoch: int, size: int, rank: int, uneven: str
) -> list | str:
    """This replica's batches of pass ``epoch``, or ``"error"`` where uneven='error' must raise."""
    out = []
    for rows in reference_orders(len(data["x"]), kwargs, shard, epoch):
        global_batch = take(data, rows)
        b = len(rows)
        empty = any(replica_slice(b, size, r)[0] == replica_slice(b, size, r)[1] for r in range(size))
        if b and empty and uneven != "pad":
            if uneven == "drop":
                break
            return "error"
        out.append(cut(global_batch, *replica_slice(b, size, rank)))
    return out


def same(got: Any, want: Any) -> bool:
    if isinstance(want, dict):
        return isinstance(got, dict) and set(got) == set(want) and all(same(got[k], want[k]) for k in want)
    got = np.asarray(got)
    return got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)


def all_same(got: list, want: list) -> bool:
    return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("uneven", ["pad", "drop"])
@pytest.mark.parametrize("case", list(CASES))
def test_replica_batches_match_a_numpy_reference_over_two_epochs(group, case, uneven):
    checks = RankChecks()
    kwargs, shard = CASES[case]
    data = make_data()
    dist = group.strategy.experimental_distribute_dataset(
        make_dataset(data, kwargs, shard), InputOptions(uneven=uneven)
    )
    detail = ""
    for epoch in range(2):
        got = [batch for batch in dist]
        want = reference_epoch(data, kwargs, shard, epoch, group.size, group.rank, uneven)
        checks.that(all_same(got, want))
        detail += f"epoch {epoch}: {len(got)} batches, want {len(want)}; "
    checks.agree(group.comm, detail)


def test_uneven_error_raises_where_the_reference_leaves_a_replica_empty(group):
    kwargs, shard = CASES["shuffled"]  # at R = 4 a batch of 5 splits 2 + 2 + 1 + 0: replica 3 is left empty
    data = make_data()
    want = reference_epoch(data, kwargs, shard, 0, group.size, group.rank, "error")
    dist = group.strategy.experimental_distribute_dataset(
        make_dataset(data, kwargs, shard), InputOptions(uneven="error")
    )
    if want == "error":
        raises_on_every_rank(group.comm, InvalidArgumentError, lambda: list(dist), "uneven")
    else:
        all_ranks_agree(group.comm, all_same(list(dist), want), "uneven='error' changed the batches")


def test_element_spec_peeks_without_losing_the_first_pass(group):
    kwargs, shard = CASES["shuffled"]
    data = make_data()
    dist = group.strategy.experimental_distribute_dataset(make_dataset(data, kwargs, shard))
    spec = dist.element_spec
    want_spec = {
        "x": mpistrat.ArraySpec((None, 3), np.dtype(np.float32)),
        "meta": {
            "i": mpistrat.ArraySpec((None,), np.dtype(np.int64)),
            "y": mpistrat.ArraySpec((None,), np.dtype(np.int32)),
        },
    }
    it = iter(dist)
    checks = RankChecks()
    checks.that(spec == want_spec and it.element_spec == want_spec)
    got = list(it)
    checks.that(all_same(got, reference_epoch(data, kwargs, shard, 0, group.size, group.rank, "pad")))
    checks.agree(group.comm, f"{spec}")


@pytest.mark.parametrize("case", list(CASES))
def test_iterating_the_dataset_directly_gives_whole_global_batches(case):
    kwargs, shard = CASES[case]
    data = make_data()
    ds = make_dataset(data, kwargs, shard)
    for epoch in range(2):
        want = [take(data, rows) for rows in reference_orders(N, kwargs, shard, epoch)]
        assert all_same(list(ds), want)


def test_ranks_reading_different_global_batches_raise_everywhere(world):
    if world.size == 1:
        pytest.skip("needs ranks that can disagree")
    n = N + 1 if world.rank == 0 else N  # rank 0's last global batch is one example longer
    dist = world.strategy.experimental_distribute_dataset(ArrayDataset(make_data(n), 5, shuffle=True))
    raises_on_every_rank(world.comm, CollectiveMismatchError, lambda: list(dist), "different global")


@pytest.mark.parametrize("shard", [False, True])
def test_ranks_at_different_passes_of_a_shuffled_dataset_raise_everywhere(world, shard):
    """Batches of the same shapes but other rows: rank 0 looked at a sample first (one pass)."""
    if world.size == 1:
        pytest.skip("needs ranks that can disagree")
    data = ArrayDataset(make_data(), 5, shuffle=True, seed=1)
    if shard:
        data = data.shard(2, 0)
    if world.rank == 0:
        next(iter(data))  # starts a pass: the next one is shuffled differently
    dist = world.strategy.experimental_distribute_dataset(data)
    message = raises_on_every_rank(
        world.comm, CollectiveMismatchError, lambda: list(dist), "different global"
    )
    assert "the global batch's rows" in message and "from the same position" in message


# -- counting: the rows each rank gathers, and the bytes each step sends ----------------------

GATHERED: list[int] = []  # rows selected by every fancy-index request on a Recorded array


class Recorded(np.ndarray):
    """An array that records how many rows each integer-array index request selects."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, np.ndarray) and key.dtype.kind in "iu":
            GATHERED.append(len(key))
        return super().__getitem__(key)


@pytest.mark.parametrize("case", ["shuffled", "shuffled-sharded", "short-batches"])
def test_each_rank_gathers_only_its_own_rows(group, case):
    checks = RankChecks()
    kwargs, shard = CASES[case]
    plain = make_data()
    data = {"x": plain["x"].view(Recorded), "meta": {k: v.view(Recorded) for k, v in plain["meta"].items()}}
    dist = group.strategy.experimental_distribute_dataset(make_dataset(data, kwargs, shard))
    GATHERED.clear()
    spec = dist.element_spec  # peeks at the first global batch: its shapes, no rows
    checks.that(spec is not None and GATHERED == [])
    detail = f"peek gathered {GATHERED}; "
    for epoch in range(2):
        GATHERED.clear()
        got = [batch for batch in dist]
        requests = list(GATHERED)
        orders = reference_orders(N, kwargs, shard, epoch)
        share = sum(
            stop - start for start, stop in (replica_slice(len(o), group.size, group.rank) for o in orders)
        )
        per_request = math.ceil(kwargs["batch_size"] / group.size)
        # 3 leaves, each gathered once per step, only this replica's rows (not the global batch)
        checks.that(  # max() once there are requests
            sum(requests) == 3 * share and len(requests) == 3 * len(orders) and max(requests) <= per_request
        )
        checks.that(
            all_same(got, reference_epoch(plain, kwargs, shard, epoch, group.size, group.rank, "pad"))
        )
        detail += f"epoch {epoch}: gathered {sum(requests)} rows in {requests}, share {share}; "
    checks.agree(group.comm, detail)


HANDSHAKE_BYTES = 256  # one step's handshake, in and out of a rank, whatever the number of ranks


def one_step_ledger(strategy: mpistrat.MPIStrategy, data: dict[str, Any], batch_size: int) -> Ledger:
    it = iter(strategy.experimental_distribute_dataset(ArrayDataset(data, batch_size, shuffle=True)))
    with Ledger.recording() as ledger:
        next(it)
    return ledger


def test_a_dataset_step_costs_one_small_handshake(group):
    data = make_data(4000)
    strategy = mpistrat.MPIStrategy(CountingComm(group.comm))
    ledger = one_step_ledger(strategy, data, 8)
    big = one_step_ledger(strategy, data, 4000)  # a global batch 500 times larger
    alone = one_step_ledger(mpistrat.MPIStrategy(CountingComm(MPI.COMM_SELF)), data, 8)  # the constant
    checks = RankChecks()
    checks.that(ledger.names() == ["Allreduce"] and big.names() == ["Allreduce"] == alone.names())
    checks.that(ledger.moved == big.moved == alone.moved <= HANDSHAKE_BYTES)
    checks.agree(group.comm, f"R={group.size}: {ledger.log} {big.log}; alone {alone.log}")


def test_an_epoch_costs_one_handshake_per_step_and_one_at_the_end(group):
    kwargs, shard = CASES["shuffled"]
    strategy = mpistrat.MPIStrategy(CountingComm(group.comm))
    dist = strategy.experimental_distribute_dataset(make_dataset(make_data(), kwargs, shard))
    with Ledger.recording() as ledger:
        steps = len(list(dist))
    ok = ledger.names() == ["Allreduce"] * (steps + 1) and ledger.moved <= (steps + 1) * HANDSHAKE_BYTES
    all_ranks_agree(group.comm, ok, f"{steps} steps: {ledger.log}")


def test_unshuffled_unsharded_batches_stay_views(group):
    kwargs, shard = CASES["plain"]
    data = make_data()
    dist = group.strategy.experimental_distribute_dataset(make_dataset(data, kwargs, shard))
    got = list(dist)
    views = all(np.shares_memory(b["x"], data["x"]) for b in got if len(b["x"]))
    ok = views and all_same(got, reference_epoch(data, kwargs, shard, 0, group.size, group.rank, "pad"))
    all_ranks_agree(group.comm, ok, f"{len(got)} batches, views {views}")
