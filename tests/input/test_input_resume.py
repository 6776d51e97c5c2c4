"""A dataset's position (pass, and examples taken in it) saved by Checkpoint: a resumed run equals an
uninterrupted one.

The references are plain NumPy: pass ``e`` of ``ArrayDataset(shuffle=True, seed=s)`` visits the
examples in ``np.random.default_rng([s, e]).permutation(n)``, batched in order, and replica r
of R keeps examples ``[r * ceil(b / R), (r + 1) * ceil(b / R))`` of a global batch of b (clipped
to b). The jobs at the end train under their own ``mpiexec`` and compare with a float64 NumPy
training loop written out here.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

import mpistrat
from mpistrat import ArrayDataset, CollectiveMismatchError, InvalidArgumentError
from mpistrat.input import saved_row
from tests.conftest import all_ranks_agree, raises_on_every_rank
from tests.support import launch

N, BATCH, SEED, EPOCHS = 23, 4, 7, 4  # 6 global batches a pass, the last one of 3


def data() -> np.ndarray:
    return np.arange(N) * 10 + 1  # values, not indices: a wrong row shows


def part(batch: np.ndarray, ranks: int, rank: int) -> list[int]:
    """Replica ``rank``'s part of a global batch, as a list."""
    per = math.ceil(len(batch) / ranks)
    return batch[rank * per : (rank + 1) * per].tolist()


def reference(epoch: int, ranks: int = 1, rank: int = 0) -> list[list[int]]:
    """This replica's part of every global batch of pass ``epoch``, from NumPy alone."""
    order = np.random.default_rng([SEED, epoch]).permutation(N)
    return [part(data()[order[lo : lo + BATCH]], ranks, rank) for lo in range(0, N, BATCH)]


def write_entry(group, tmp_path, value: np.ndarray) -> str:
    """A checkpoint file whose entry ``data`` is ``value``, as a damaged or foreign checkpoint holds it."""
    with group.strategy.scope():
        entry = mpistrat.Variable(value)
    return mpistrat.Checkpoint(data=entry).write(os.path.join(shared_dir(group, tmp_path), "ckpt"))


def shared_dir(group, tmp_path) -> str:
    return group.comm.bcast(str(tmp_path) if group.rank == 0 else None, root=0)


def distributed(group, dataset=None):
    dataset = ArrayDataset(data(), BATCH, shuffle=True, seed=SEED) if dataset is None else dataset
    return dataset, group.strategy.experimental_distribute_dataset(dataset)


def agree(group, got, want) -> None:
    all_ranks_agree(group.comm, got == want, f"got {got}, want {want}")


# -- experimental_distribute_dataset: the dataset tracked, re-iterated every epoch ------------------


@pytest.mark.parametrize(
    "stop", [(2, 0), (1, 2), (1, 6), (0, 1)], ids=["end-of-pass", "mid", "last", "first"]
)
def test_a_resumed_run_reads_what_an_uninterrupted_one_reads(group, tmp_path, stop):
    """Stopped after ``stop`` = (passes, batches of the next pass), saved, resumed in a new dataset."""
    passes, taken = stop
    want = [b for e in range(EPOCHS) for b in reference(e, group.size, group.rank)]
    dataset, dist = distributed(group)
    ckpt = mpistrat.Checkpoint(data=dist)
    got = []
    for _ in range(passes):
        got += [x.tolist() for x in dist]
    it = iter(dist)
    got += [next(it).tolist() for _ in range(taken)]
    path = ckpt.write(os.path.join(shared_dir(group, tmp_path), "ckpt"))

    dataset, dist = distributed(group)
    mpistrat.Checkpoint(data=dist).read(path).assert_consumed()
    restored = dataset.epoch
    for _ in range(dataset.epoch, EPOCHS):
        got += [x.tolist() for x in dist]
    agree(group, (restored, got), (passes, want))


def test_the_position_is_saved_as_epoch_and_examples(group, tmp_path):
    """Pass 1 after two global batches of 4: 8 examples, with the dataset's digests."""
    dataset, dist = distributed(group)
    ckpt = mpistrat.Checkpoint(data=dist)
    list(dist)
    it = iter(dist)
    next(it), next(it)
    path = ckpt.write(os.path.join(shared_dir(group, tmp_path), "ckpt"))
    saved = saved_row.decode(saved_position(path, "data"))
    agree(group, (saved.epoch, saved.examples, saved.identity), (1, 2 * BATCH, dataset.identity))


def saved_position(path, name):
    """A dataset's position as the checkpoint file's metadata holds it (read with safetensors)."""
    with safe_open(path, framework="numpy") as f:
        return json.loads(f.metadata()["positions"])[name]


def test_a_tracked_iterator_resumes_its_pass(group, tmp_path):
    """tf's style: ``Checkpoint(iterator=it)``; restoring into an iterator already read resets it."""
    _, dist = distributed(group)
    it = iter(dist)
    for _ in range(2):
        next(it)
    path = mpistrat.Checkpoint(iterator=it).write(os.path.join(shared_dir(group, tmp_path), "ckpt"))
    _, dist = distributed(group)
    it = iter(dist)
    first = next(it).tolist()  # pass 0's first batch, forgotten by the restore
    mpistrat.Checkpoint(iterator=it).read(path).assert_consumed()
    got = [x.tolist() for x in it]
    then = [x.tolist() for x in dist]
    want = reference(0, group.size, group.rank)
    agree(group, (first, got, then), (want[0], want[2:], reference(1, group.size, group.rank)))


def test_make_dataset_iterator_is_tracked_too(group, tmp_path):
    dataset = ArrayDataset(data(), BATCH, shuffle=True, seed=SEED)
    iterator = group.strategy.make_dataset_iterator(dataset)
    for _ in range(3):
        iterator.get_next()
    path = mpistrat.Checkpoint(it=iterator).write(os.path.join(shared_dir(group, tmp_path), "ckpt"))
    iterator = group.strategy.make_dataset_iterator(ArrayDataset(data(), BATCH, shuffle=True, seed=SEED))
    mpistrat.Checkpoint(it=iterator).read(path)
    agree(group, [x.tolist() for x in iterator], reference(0, group.size, group.rank)[3:])


class Loader:
    """A re-iterable loader that counts the batches it yields; its data do not depend on the pass."""

    def __init__(self, batches):
        self.batches, self.read = batches, 0

    def __iter__(self):
        for b in self.batches:
            self.read += 1
            yield b

    def __len__(self):
        return len(self.batches)


def test_other_iterables_resume_by_skipping(group, tmp_path):
    batches = [np.arange(i, i + 3) for i in range(0, 15, 3)]
    dist = group.strategy.experimental_distribute_dataset(Loader(batches))
    it = iter(dist)
    next(it), next(it)
    path = mpistrat.Checkpoint(data=dist).write(os.path.join(shared_dir(group, tmp_path), "ckpt"))
    loader = Loader(batches)
    dist = group.strategy.experimental_distribute_dataset(loader)
    mpistrat.Checkpoint(data=dist).read(path)
    got = [x.tolist() for x in dist]
    want = [part(b, group.size, group.rank) for b in batches[2:]]
    agree(group, (got, loader.read), (want, 5))  # 2 batches read and dropped, 3 yielded
    agree(group, len([x for x in dist]), 5)  # the next pass is whole


def test_a_generator_resumes_by_skipping_what_is_left_of_it(group, tmp_path):
    _, dist = distributed(group)
    it = iter(dist)
    next(it), next(it), next(it)
    path = mpistrat.Checkpoint(data=dist).write(os.path.join(shared_dir(group, tmp_path), "ckpt"))
    dist = group.strategy.experimental_distribute_dataset(np.full((2,), i) for i in range(9))
    _ = dist.element_spec  # the peeked batch still counts among those skipped
    mpistrat.Checkpoint(data=dist).read(path)  # 3 batches of 4 taken: 12 examples, 6 batches of 2 here
    agree(
        group, [x.tolist() for x in dist], [part(np.full((2,), i), group.size, group.rank) for i in (6, 7, 8)]
    )


# -- set_epoch: the position without a checkpoint --------------------------------------------------


def test_set_epoch_positions_the_next_pass(group):
    dataset, dist = distributed(group)
    dataset.set_epoch(5, step=4)
    got = [[x.tolist() for x in dist] for _ in range(2)]
    want = [reference(e, group.size, group.rank) for e in (5, 6)]
    agree(group, (got, dataset.epoch), ([want[0][4:], want[1]], 7))


def test_iterating_an_array_dataset_directly_counts_passes():
    dataset = ArrayDataset(data(), BATCH, shuffle=True, seed=SEED)
    first = [b.tolist() for b in dataset]
    it = iter(dataset)
    next(it)  # pass 1 left early: the next pass is 2
    assert (first, dataset.epoch) == (reference(0), 1)
    assert [b.tolist() for b in dataset] == reference(2) and dataset.epoch == 3
    dataset.set_epoch(0, step=len(dataset))
    assert list(dataset) == [] and dataset.epoch == 1


@pytest.mark.parametrize(
    "epoch,step,match",
    [
        (-1, 0, "epoch must be an int >= 0; got -1"),
        (1.0, 0, "epoch must be an int >= 0; got 1.0"),
        (0, -2, "step must be an int >= 0; got -2"),
        (3, 7, "step 7 is past the end of a pass of 6 batches; expected a step in [0, 6]"),
    ],
)
def test_set_epoch_rejects_bad_positions(epoch, step, match):
    dataset = ArrayDataset(data(), BATCH, shuffle=True)
    with pytest.raises(InvalidArgumentError, match=match.replace("[", r"\[").replace("]", r"\]")):
        dataset.set_epoch(epoch, step=step)


# -- distribute_datasets_from_function: one position per rank, at the same number of ranks ----------


def pipelines(group, made=None, batch=2):
    """Per-rank pipelines: rank r's shard of each pass's order, batched by ``batch``."""
    made = [] if made is None else made

    def dataset_fn(ctx):
        ds = ArrayDataset(data(), batch, shuffle=True, seed=SEED)
        made.append(ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id))
        return made[-1]

    return group.strategy.distribute_datasets_from_function(dataset_fn)


def shard_reference(epoch, ranks, rank, batch=2):
    shard = np.random.default_rng([SEED, epoch]).permutation(N)[rank::ranks]
    return [data()[shard[i : i + batch]].tolist() for i in range(0, len(shard), batch)]


def test_pipelines_after_a_pass_resumed_at_its_end_pad_the_next(group):
    """Every pipeline empty at the first step agrees on no element spec; the next pass must still agree
    on one, to pad the shorter pipelines (23 examples: at 3 ranks, shards of 8, 8 and 7)."""
    made = []
    dist = pipelines(group, made, batch=1)
    made[0].set_epoch(0, step=len(made[0]))
    first, second = [x.tolist() for x in dist], [x.tolist() for x in dist]
    mine = shard_reference(1, group.size, group.rank, batch=1)
    agree(group, (first, second), ([], mine + [[]] * (math.ceil(N / group.size) - len(mine))))


def test_pipelines_resume_at_the_same_number_of_ranks(group, tmp_path):
    dist = pipelines(group)
    list(dist)
    it = iter(dist)
    next(it), next(it), next(it)
    path = mpistrat.Checkpoint(data=dist).write(os.path.join(shared_dir(group, tmp_path), "ckpt"))
    value = saved_position(path, "data")
    made = []
    dist = pipelines(group, made)
    mpistrat.Checkpoint(data=dist).read(path).assert_consumed()
    got = [[x.tolist() for x in dist] for _ in range(2)]
    mine = [shard_reference(e, group.size, group.rank) for e in (1, 2)]
    longest = math.ceil(math.ceil(N / group.size) / 2)  # steps a pass takes: the longest pipeline's
    padded = [mine[0][3:] + [[]] * (longest - len(mine[0])), mine[1] + [[]] * (longest - len(mine[1]))]
    rows = [(r.epoch, r.examples) for r in map(saved_row.decode, value)]
    taken = [
        sum(map(len, shard_reference(1, group.size, r)[:3])) for r in range(group.size)
    ]  # 5 on the short shard at 4 ranks
    agree(group, (rows, got, made[0].epoch), ([(1, t) for t in taken], padded, 3))


def test_pipelines_refuse_a_position_saved_at_another_number_of_ranks(group, tmp_path):
    path = write_entry(group, tmp_path, np.zeros((group.size + 1, 2), np.int64))  # as 1 more rank saves it
    message = raises_on_every_rank(
        group.comm, InvalidArgumentError, lambda: mpistrat.Checkpoint(data=pipelines(group)).read(path)
    )
    assert f"saved at {group.size + 1} ranks and this job has {group.size}" in message, message


# -- errors ---------------------------------------------------------------------------------------


def test_restoring_past_the_end_of_a_pass_raises_on_every_rank(group, tmp_path):
    path = write_entry(group, tmp_path, np.array([2, 9], np.int64))
    _, dist = distributed(group)
    message = raises_on_every_rank(
        group.comm, InvalidArgumentError, lambda: mpistrat.Checkpoint(data=dist).read(path)
    )
    assert "step 9 is past the end of a pass of 6 batches; expected a step in [0, 6]" in message


def test_restoring_a_negative_epoch_raises(group, tmp_path):
    path = write_entry(group, tmp_path, np.array([-1, 0], np.int64))
    _, dist = distributed(group)
    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: mpistrat.Checkpoint(data=dist).read(path),
        "epoch must be an int >= 0; got -1",
    )


@pytest.mark.parametrize("value", [np.zeros(3, np.int64), np.zeros(2, np.float32)], ids=["shape", "dtype"])
def test_a_position_entry_of_the_wrong_shape_or_dtype_raises(group, tmp_path, value):
    path = write_entry(group, tmp_path, value)
    _, dist = distributed(group)
    message = raises_on_every_rank(
        group.comm, InvalidArgumentError, lambda: mpistrat.Checkpoint(data=dist).read(path)
    )
    held = f"{value.dtype}{list(value.shape)}"
    assert (
        f"expected int64[2] (the pass, and the examples taken in it), the checkpoint holds {held}" in message
    )


def test_an_array_dataset_itself_is_not_a_checkpoint_entry():
    with pytest.raises(InvalidArgumentError, match="a distributed dataset or iterator"):
        mpistrat.Checkpoint(data=ArrayDataset(data(), BATCH))


def test_ranks_at_different_positions_raise_at_the_next_step_and_at_a_save(world, tmp_path):
    if world.size == 1:
        pytest.skip("needs ranks that can disagree")
    dataset, dist = distributed(world)
    dataset.set_epoch(int(world.rank == 0))
    ckpt = mpistrat.Checkpoint(data=dist)
    directory = shared_dir(world, tmp_path)
    message = raises_on_every_rank(
        world.comm, CollectiveMismatchError, lambda: ckpt.write(os.path.join(directory, "ckpt"))
    )
    assert "different positions" in message and not os.listdir(directory)
    raises_on_every_rank(world.comm, CollectiveMismatchError, lambda: list(dist), "different global")


# -- training jobs under their own mpiexec --------------------------------------------------------

TOTAL = 30


def run_job(ranks: int, directory: Path, stop: str, *flags: str, status: int = 0, limit: float = 60) -> dict:
    """Run tests/input/input_resume_job.py; its report (after a stop: {}), or fail with its output."""
    directory.mkdir(exist_ok=True)
    out = directory / "report.json"
    script = launch.ROOT / "tests" / "input" / "input_resume_job.py"
    code, output = launch.run_job(
        script, str(directory), str(TOTAL), stop, str(out), *flags, ranks=ranks, limit=limit
    )
    assert code == status, output
    return json.loads(out.read_text()) if out.exists() else {}


def numpy_training(ranks: int | None = None) -> np.ndarray:
    """The job's 30 epochs in float64: one global batch per step (``ranks``: per-rank shards)."""
    from tests.input.input_resume_job import GLOBAL_BATCH, LR, MOMENTUM, SEED, X, Y

    w, v = np.zeros(4), np.zeros(4)  # [w0, w1, w2, b]
    xs = np.hstack([X, np.ones((len(X), 1))]).astype(np.float64)
    for epoch in range(TOTAL):
        order = np.random.default_rng([SEED, epoch]).permutation(len(X))
        if ranks is None:
            steps = [order[lo : lo + GLOBAL_BATCH] for lo in range(0, len(X), GLOBAL_BATCH)]
        else:
            per, shards = GLOBAL_BATCH // ranks, [order[r::ranks] for r in range(ranks)]
            count = max(math.ceil(len(s) / per) for s in shards)
            steps = [np.concatenate([s[k * per : (k + 1) * per] for s in shards]) for k in range(count)]
        for rows in steps:
            err = xs[rows] @ w - Y[rows]
            v = MOMENTUM * v - LR * (2 * xs[rows].T @ err / len(rows))
            w = w + v
    return w


def weights(report: dict) -> np.ndarray:
    return np.array([*report["w"], report["b"]])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The report of a run of all 30 epochs at ``ranks`` (with ``--pipelines``, if given), run once."""
    reports: dict[tuple[int, tuple[str, ...]], dict] = {}

    def get(ranks: int, *flags: str) -> dict:
        if (ranks, flags) not in reports:
            reports[ranks, flags] = run_job(ranks, tmp_path_factory.mktemp("whole"), "none", *flags)
        return reports[ranks, flags]

    return get


@pytest.mark.serial
@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("pipelines", [False, True], ids=["split", "pipelines"])
def test_uninterrupted_training_matches_numpy(uninterrupted, ranks, pipelines):
    report = uninterrupted(ranks, *["--pipelines"] * pipelines)
    assert report["start"] == [0, 0] and report["steps"] == 150 and report["epoch"] == TOTAL
    want = numpy_training(ranks if pipelines else None)
    np.testing.assert_allclose(weights(report), want, rtol=1e-5, atol=1e-6)


@pytest.mark.serial
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "saved,resumed,stop",
    [(2, 2, "step=77"), (3, 3, "epoch=15"), (3, 3, "step=75"), (2, 3, "epoch=15"), (3, 2, "step=77")],
)
def test_training_stopped_and_resumed_ends_where_an_uninterrupted_run_does(
    tmp_path, uninterrupted, saved, resumed, stop
):
    """30 epochs of 5 steps, stopped after 15 epochs (``epoch=15``: after the loop saw the pass end;
    ``step=75``: after its last batch) or in epoch 15 (``step=77``), resumed at ``resumed`` ranks."""
    assert run_job(saved, tmp_path, stop) == {}
    parts = run_job(resumed, tmp_path, "none")
    start = {"epoch=15": [15, 75], "step=75": [14, 75], "step=77": [15, 77]}[stop]  # [epoch, step] restored
    assert parts["start"] == start and parts["steps"] == 150 and parts["epoch"] == TOTAL
    same_as(parts, uninterrupted(resumed), exact=saved == resumed)


def same_as(parts: dict, whole: dict, exact: bool) -> None:
    """At the same number of ranks the same steps reduce in the same order: the same bits."""
    if exact:
        np.testing.assert_array_equal(weights(parts), weights(whole))
    else:
        np.testing.assert_allclose(weights(parts), weights(whole), rtol=1e-6, atol=1e-7)


@pytest.mark.serial
@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranks,stop", [(2, "step=27"), (3, "epoch=4"), (3, "step=25")])
def test_per_rank_pipelines_resume_at_the_same_number_of_ranks(tmp_path, uninterrupted, ranks, stop):
    """At 3 ranks rank 2's shard has a batch fewer: ``step=25`` stops after a step where it had none,
    so the ranks save different positions (ranks 0 and 1: [4, 5], rank 2: [4, 4])."""
    assert run_job(ranks, tmp_path, stop, "--pipelines") == {}
    parts = run_job(ranks, tmp_path, "none", "--pipelines")
    same_as(parts, uninterrupted(ranks, "--pipelines"), exact=True)


@pytest.mark.serial
@pytest.mark.timeout(60)
def test_per_rank_pipelines_refuse_another_number_of_ranks(tmp_path):
    run_job(2, tmp_path, "epoch=3", "--pipelines")
    with pytest.raises(AssertionError) as failed:
        run_job(3, tmp_path, "none", "--pipelines")
    assert "saved at 2 ranks and this job has 3" in str(failed.value)


@pytest.mark.serial
@pytest.mark.timeout(60)
@pytest.mark.parametrize("saved,resumed", [(2, 2), (3, 2)])
def test_a_preempted_job_resumes_where_it_stopped(tmp_path, uninterrupted, saved, resumed):
    """docs/preemption.md's loop: a SIGUSR1 on the last rank after step 77; the handler saves at the
    end of that step or the next, exits with 75, and the next run's handler restores."""
    assert run_job(saved, tmp_path, "signal=77", "--preemptible", status=75) == {}
    parts = run_job(resumed, tmp_path, "none", "--preemptible")
    assert parts["start"][1] in (77, 78) and parts["steps"] == 150
    same_as(parts, uninterrupted(resumed), exact=saved == resumed)


def test_unbatched_elements_resume_where_they_stopped(group, tmp_path):
    """A dataset of unbatched scalars, one per replica per step: a position saved after one step
    holds R examples, and the resumed pass deals every remaining element to exactly one replica."""
    n, r = group.size, group.rank
    values = [np.float32(v) for v in range(100, 107)]  # float32 scalars, as a port passes them
    dist = group.strategy.experimental_distribute_dataset(values)
    it = iter(dist)
    first = [float(next(it))] if r < len(values) else []
    path = mpistrat.Checkpoint(data=dist).write(os.path.join(shared_dir(group, tmp_path), "ckpt"))
    saved = saved_row.decode(saved_position(path, "data"))

    dist = group.strategy.experimental_distribute_dataset(list(values))
    mpistrat.Checkpoint(data=dist).read(path).assert_consumed()
    rest = [float(x) for step, x in enumerate(dist) if (step + 1) * n + r < len(values)]
    everyone = sorted(v for vs in group.comm.allgather(first + rest) for v in vs)
    agree(group, (saved.epoch, saved.examples, everyone), (0, n, [float(v) for v in range(100, 107)]))
