"""A resume into a dataset that changed between the save and the restore.

The position counts examples, so a global batch that changed with the number of replicas (tf's
``GLOBAL = PER_REPLICA * num_replicas_in_sync``, saved at 2 ranks and resumed at 4) resumes at
the example where the save stood; a dataset that is not the one saved (another shuffle seed, or
another number of examples) is refused on every rank, saying what changed. The references are
NumPy's: pass ``e`` visits ``np.random.default_rng([seed, e]).permutation(n)``, in global batches
of ``b`` examples of which replica ``r`` of ``R`` keeps ``[r * ceil(b / R), (r + 1) * ceil(b / R))``.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

import mpistrat
from mpistrat import ArrayDataset, InvalidArgumentError
from tests.conftest import all_ranks_agree, raises_on_every_rank

N, SEED = 96, 7


def order(epoch: int, seed: int = SEED, n: int = N) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def parts(examples: np.ndarray, batch: int, ranks: int, rank: int) -> list[list[int]]:
    """This replica's part of each global batch of ``batch`` of ``examples``, in order."""
    out = []
    for lo in range(0, len(examples), batch):
        global_batch = examples[lo : lo + batch]
        per = math.ceil(len(global_batch) / ranks)
        out.append(global_batch[rank * per : (rank + 1) * per].tolist())
    return out


def save_after(group, tmp_path, dataset, steps: int) -> str:
    """Take ``steps`` global batches of ``dataset``'s pass 0, then save its position."""
    dist = group.strategy.experimental_distribute_dataset(dataset)
    it = iter(dist)
    for _ in range(steps):
        next(it)
    directory = group.comm.bcast(str(tmp_path) if group.rank == 0 else None, root=0)
    return mpistrat.Checkpoint(data=dist).write(os.path.join(directory, "ckpt"))


def restored(group, path, dataset):
    dist = group.strategy.experimental_distribute_dataset(dataset)
    mpistrat.Checkpoint(data=dist).read(path).assert_consumed()
    return dist


@pytest.mark.parametrize("saved,resumed", [(16, 32), (32, 16), (16, 24)])
def test_a_global_batch_that_changed_resumes_at_the_same_example(group, tmp_path, saved, resumed):
    """Two batches of ``saved`` taken: the rest of pass 0 is the order from example ``2 * saved`` on,
    in batches of ``resumed`` (whatever their boundaries), then pass 1 whole."""
    data = np.arange(N) * 10 + 1
    path = save_after(group, tmp_path, ArrayDataset(data, saved, shuffle=True, seed=SEED), 2)
    dist = restored(group, path, ArrayDataset(data, resumed, shuffle=True, seed=SEED))
    got = [[x.tolist() for x in dist] for _ in range(2)]
    want = [
        parts(data[order(0)[2 * saved :]], resumed, group.size, group.rank),
        parts(data[order(1)], resumed, group.size, group.rank),
    ]
    all_ranks_agree(group.comm, got == want, f"got {got}, want {want}")


def batches_of(size: int) -> list[np.ndarray]:
    return [np.arange(i, min(i + size, 12), dtype=np.int64) for i in range(0, 12, size)]


def test_another_iterable_resumes_at_the_same_example_or_refuses(group, tmp_path):
    """Two batches of 3 taken (6 examples): batches of 2 resume at their fourth; in batches of 4 the
    sixth example falls inside the second batch, which is refused instead of skipping a part of it."""
    path = save_after(group, tmp_path, batches_of(3), 2)
    dist = restored(group, path, batches_of(2))
    got = [x.tolist() for x in dist]
    want = parts(np.arange(6, 12), 2, group.size, group.rank)
    all_ranks_agree(group.comm, got == want, f"got {got}, want {want}")
    message = raises_on_every_rank(
        group.comm, InvalidArgumentError, lambda: list(restored(group, path, batches_of(4)))
    )
    assert "after 6 examples" in message and "inside a batch" in message, message


@pytest.mark.parametrize(
    "change,says",
    [
        ({"seed": 8}, "the order of its examples (shuffle, seed or sharding)"),
        ({"shuffle": False}, "the order of its examples (shuffle, seed or sharding)"),
        ({"n": N + 4}, "its examples per pass"),
    ],
    ids=["seed", "shuffle", "length"],
)
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_a_dataset_that_changed_is_refused_saying_what_changed(group, tmp_path, change, says, dtype):
    """Resuming pass 0 after 32 examples in another order, or of another dataset, would visit some
    examples twice and others never: every rank raises, naming what differs and what it is now."""
    path = save_after(
        group, tmp_path, ArrayDataset(np.arange(N, dtype=dtype), 16, shuffle=True, seed=SEED), 2
    )
    n = change.get("n", N)
    now = ArrayDataset(
        np.arange(n, dtype=dtype), 16, shuffle=change.get("shuffle", True), seed=change.get("seed", SEED)
    )
    message = raises_on_every_rank(group.comm, InvalidArgumentError, lambda: restored(group, path, now))
    assert says in message and "pass 0 after 32 examples" in message, message
    assert f"{n} examples" in message, message


def test_per_rank_pipelines_whose_batch_changed_resume_at_the_same_example(group, tmp_path):
    """Each rank's shard, saved after 2 batches of 4 and resumed in batches of 3."""

    def pipelines(batch):
        def dataset_fn(ctx):
            ds = ArrayDataset(np.arange(N), batch, shuffle=True, seed=SEED)
            return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)

        return group.strategy.distribute_datasets_from_function(dataset_fn)

    dist = pipelines(4)
    it = iter(dist)
    next(it), next(it)
    directory = group.comm.bcast(str(tmp_path) if group.rank == 0 else None, root=0)
    path = mpistrat.Checkpoint(data=dist).write(os.path.join(directory, "ckpt"))
    dist = pipelines(3)
    mpistrat.Checkpoint(data=dist).read(path).assert_consumed()
    got = [x.tolist() for x in dist]
    shard = order(0)[group.rank :: group.size][8:]
    want = [shard[i : i + 3].tolist() for i in range(0, len(shard), 3)]
    all_ranks_agree(group.comm, got == want, f"got {got}, want {want}")
