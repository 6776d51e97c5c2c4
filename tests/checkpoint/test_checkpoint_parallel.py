"""Every rank writes its share and reads what it will hold: counted, not timed.

The file bytes a rank moves are read from the kernel's own count (``/proc/self/io``: the bytes
this process handed to ``write`` and got from ``read`` system calls, whoever made them, MPI-IO
included); the bytes between ranks from a counting communicator; memory from ``tracemalloc``.
Restores at other rank counts run in one job: the world's strategy, an even/odd split of it
and a one-rank strategy save and restore each other's files.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import mpistrat
import mpistrat.checkpoint.mpiio as mpiio
import mpistrat.checkpoint.pieces as pieces_module
import mpistrat.checkpoint.restoring as restoring
from mpistrat.checkpoint.files import read_table
from mpistrat.optimizers import Adam
from tests.checkpoint.test_checkpoint import shared_dir
from tests.conftest import _GROUPS, WORLD, RankChecks, _make, all_ranks_agree
from tests.support.counting import CountingComm, Ledger
from tests.support.launch import run_job

SHAPES = [(300, 41), (7,), (), (1000,), (5, 3, 11), (0, 4), (2049,)]  # uneven on purpose
LARGE = [(512, 256), (1000,), (3, 7), (256, 300)]  # 2.5 MB with Adam's slots
SLACK = 64 << 10  # bytes: a header, a stack of small pickles, logging


def values(k, shape, dtype=np.float32):
    """Variable k's value: the same at any rank count, different per variable."""
    return ((np.arange(int(np.prod(shape))) * 7 + 13 * k) % 101 - 50).reshape(shape).astype(dtype) / 4


def make_state(strategy, shard, zero=False, shapes=SHAPES):
    with strategy.scope():
        ws = [mpistrat.Variable(values(k, s) * (not zero), name=f"w{k}") for k, s in enumerate(shapes)]
        step = mpistrat.Variable(np.int64(0 if zero else 11), name="step")
        opt = Adam(0.1, shard_state=shard)
        opt.build(ws)
        if not zero:
            for k, w in enumerate(ws):
                for j, name in enumerate(opt.slot_names):
                    opt.get_slot(w, name).assign(values(k + 10 * (j + 1), w.shape))
            opt.iterations.assign(5)
    return mpistrat.Checkpoint(model=ws, step=step, opt=opt), ws, opt


def expected(opt_slot_names=("m", "v")):
    want = {f"model/{k}": values(k, s) for k, s in enumerate(SHAPES)}
    for k, s in enumerate(SHAPES):
        for j, name in enumerate(opt_slot_names):
            want[f"opt/slots/model/{k}/{name}"] = values(k + 10 * (j + 1), s)
    return want


def current(strategy, ws, opt):
    """Every entry's value as NumPy, read in the strategy's scope (collective for sharded slots)."""
    with strategy.scope():
        got = {f"model/{k}": w.numpy() for k, w in enumerate(ws)}
        for k, w in enumerate(ws):
            for name in opt.slot_names:
                got[f"opt/slots/model/{k}/{name}"] = np.asarray(opt.get_slot(w, name).numpy())
        got["iterations"] = int(opt.iterations.numpy())
    return got


def io_counts():
    """This process's (bytes read, bytes written) through system calls so far."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


needs_proc_io = pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's /proc/self/io")


@needs_proc_io
@pytest.mark.parametrize("shard", [False, True])
def test_each_rank_writes_and_reads_its_share_and_no_rank_gathers_state(tmp_path, shard):
    size = WORLD.Get_size()
    strategy = mpistrat.MPIStrategy(CountingComm(WORLD))
    directory = WORLD.bcast(str(tmp_path), root=0)
    ckpt, _, _ = make_state(strategy, shard)
    path = os.path.join(directory, "ckpt")
    ckpt.write(path)  # the first write makes the folder, imports, warms caches
    _, w0 = io_counts()
    with Ledger.recording() as saved:
        ckpt.write(path)
    r1, w1 = io_counts()
    table = read_table(path)
    data = sum(e.nbytes for e in table.entries.values())
    header = table.data_start
    with Ledger.recording() as restored:
        ckpt.read(path)
    r2, _ = io_counts()
    wrote, read = w1 - w0, r2 - r1
    share = data / size
    problems = []
    if not (wrote <= share * 1.05 + header + SLACK and read <= share * 1.05 + 2 * header + SLACK):
        problems.append(f"file bytes written {wrote}, read {read}; data {data} over {size} ranks")
    if sum(WORLD.allgather(wrote)) < data:
        problems.append(f"the ranks wrote {sum(WORLD.allgather(wrote))} bytes of {data}")
    if saved.moved > SLACK:  # a save moves no data between ranks: each writes its own share
        problems.append(f"a save moved {saved.moved} bytes between ranks: {saved.names()}")
    gathers = restored.only("Allgather", "Allgatherv")
    whole = data if not shard else sum(e.nbytes for n, e in table.entries.items() if "/slots/" not in n)
    if gathers.received > whole + SLACK or gathers.sent > whole / size * 1.05 + SLACK:
        problems.append(f"a restore gathered {gathers.received} bytes, sent {gathers.sent}; whole {whole}")
    if restored.without("Allgather", "Allgatherv").moved > SLACK * max(1, size / 4):
        problems.append(f"a restore moved {restored.without('Allgather', 'Allgatherv').moved} bytes besides")
    all_ranks_agree(WORLD, not problems, "; ".join(problems))
    strategy.experimental_finalize()


@needs_proc_io
@pytest.mark.serial("starts its own jobs, at sizes the suite's runs do not reach")
@pytest.mark.parametrize("ranks", [3, 6, 8])
def test_each_rank_writes_its_own_share_at_3_6_and_8_ranks_no_aggregator(tmp_path, ranks):
    """With one aggregator per node (ROMIO's default where the ranks' runs interleave, as a view over
    several runs does) rank 0 wrote 2.4x its share at 3 ranks, 8.8x at 6 and the others less; each
    rank must write (and read) its own share, unsharded, sharded, and sharded in packs (its parts
    many runs of the file), on whichever MPI family runs the suite."""
    out = tmp_path / "counted.json"
    code, text = run_job(
        Path(__file__).parent / "io_share_job.py", str(out), str(tmp_path), ranks=ranks, limit=240
    )
    assert code == 0, text
    problems = []
    for name, counted in json.loads(out.read_text()).items():
        share, header = counted["data"] / ranks, counted["header"]
        for what, moved in (("wrote", counted["wrote"]), ("read", counted["read"])):
            ratios = [round(m / share, 3) for m in moved]
            if not all(share * 0.98 <= m <= share * 1.02 + 2 * header + SLACK for m in moved):
                problems.append(f"{name}: each rank {what} {ratios} of its share")
    assert not problems, problems


@pytest.mark.parametrize("shard", [False, True])
def test_a_ranks_share_of_the_replicated_values_is_one_run_of_the_file(group, tmp_path, monkeypatch, shard):
    """Laid out in file order (not the order the checkpoint tracks them), a rank's share of the
    values every rank holds is one run of the file, written in one call with its sharded parts."""
    written = []
    real = mpiio.write_rounds

    def spy(fh, calls, rounds, path):
        written.append((calls, rounds))
        return real(fh, calls, rounds, path)

    monkeypatch.setattr(mpiio, "write_rounds", spy)
    ckpt, _, _ = make_state(group.strategy, shard)
    ckpt.write(os.path.join(shared_dir(group, tmp_path), "ckpt"))
    ((calls, rounds),) = written
    mine = [p for call in calls for p in call]
    replicated = pieces_module.calls([p for p in mine if not (shard and "/slots/" in p.entry)])
    ok = len(replicated) <= 1 and (
        rounds == 1 if mpiio.VIEWS else len(calls) == len(pieces_module.calls(mine))
    )
    all_ranks_agree(group.comm, ok, f"{len(replicated)} runs of replicated values; {rounds} rounds")


@pytest.mark.parametrize("shard", [False, True])
def test_memory_of_a_save_and_a_restore_is_at_most_a_share(group, tmp_path, shard, monkeypatch):
    """A save copies nothing (MPI-IO writes from the variables); an async save holds a copy of its
    share; a restore holds the share it read and one batch of small entries."""
    import tracemalloc

    monkeypatch.setattr(restoring, "BATCH", 64 << 10)
    directory = shared_dir(group, tmp_path)
    ckpt, _, _ = make_state(group.strategy, shard, shapes=LARGE)
    path = ckpt.write(os.path.join(directory, "ckpt"))
    data = sum(e.nbytes for e in read_table(path).entries.values())
    share = data / group.size
    peaks = {}
    tracemalloc.start()
    try:
        for name, action in (
            ("save", lambda: ckpt.write(path)),
            (
                "async save",
                lambda: (ckpt.write(path, mpistrat.CheckpointOptions(enable_async=True)), ckpt.sync()),
            ),
            ("restore", lambda: ckpt.read(path)),
        ):
            group.strategy.extended.collectives.caches.clear()
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            action()
            peaks[name] = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    # A save's bookkeeping (its pieces, their checksums and the copies' to compare, rank 0's header
    # and what it gathers) is some 40 KiB whatever the size of the data: well below one share.
    checks = RankChecks()
    checks.that(peaks["save"] <= 2 * SLACK and peaks["async save"] <= share * 1.05 + SLACK)
    checks.that(peaks["restore"] <= share * 1.05 + restoring.BATCH + SLACK)
    checks.that(data > 8 * SLACK)
    checks.agree(group.comm, f"peaks {peaks}, data {data}, share {share:.0f}")


def every_size():
    """The session's strategies over the world, an even/odd half of it, and this rank alone."""
    for name in ("world", "split", "self"):
        if name not in _GROUPS:
            _GROUPS[name] = _make(name)
    return [_GROUPS[n] for n in ("world", "split", "self")]


def test_every_rank_count_and_sharding_restores_every_other_bitwise(tmp_path, monkeypatch):
    """Saved at R (sharded or not), restored at R, about R/2 and 1 (sharded or not): the same bits.
    Small calls, windows and batches, so that every entry crosses their edges unevenly."""
    monkeypatch.setattr(pieces_module, "CALL_LIMIT", 4099)
    monkeypatch.setattr(restoring, "WINDOW", 8192)
    monkeypatch.setattr(restoring, "SMALL", 4096)
    monkeypatch.setattr(restoring, "BATCH", 3000)
    directory = WORLD.bcast(str(tmp_path), root=0)
    want = expected()
    problems = []
    for saver in every_size():
        for shard_save in (False, True):
            # one file per group: a split's two halves write two, every rank alone its own
            leader = saver.comm.bcast(WORLD.Get_rank(), root=0)
            path = os.path.join(directory, f"{saver.name}-{shard_save}-{leader}")
            make_state(saver.strategy, shard_save)[0].write(path)
            WORLD.Barrier()
            for restorer in every_size():
                for shard in (False, True):
                    ckpt, ws, opt = make_state(restorer.strategy, shard, zero=True)
                    ckpt.restore(path).assert_consumed()
                    got = current(restorer.strategy, ws, opt)
                    wrong = [
                        k for k, v in want.items() if got[k].dtype != v.dtype or not np.array_equal(got[k], v)
                    ]
                    if wrong or got["iterations"] != 5:
                        problems.append(f"{saver.name}/{shard_save} -> {restorer.name}/{shard}: {wrong[:3]}")
    all_ranks_agree(WORLD, not problems, "; ".join(problems[:4]))


def test_a_large_entry_in_many_calls_and_windows_restores_bitwise(group, tmp_path, monkeypatch):
    """More than one MPI-IO call per rank, and a large entry gathered in several windows."""
    checks = RankChecks()
    monkeypatch.setattr(pieces_module, "CALL_LIMIT", 1000)
    monkeypatch.setattr(restoring, "WINDOW", 3000)
    monkeypatch.setattr(restoring, "SMALL", 512)
    directory = shared_dir(group, tmp_path)
    value = values(3, (4099,), np.float64)
    with group.strategy.scope():
        big = mpistrat.Variable(value)
        small = mpistrat.Variable(values(4, (9,), np.float16))
        on_read = mpistrat.Variable(np.zeros(2000), synchronization="ON_READ", aggregation="MEAN")
    group.strategy.run(lambda: on_read.assign(np.arange(2000.0)))
    ckpt = mpistrat.Checkpoint(big=big, small=small, on_read=on_read)
    path = ckpt.write(os.path.join(directory, "big"))
    with group.strategy.scope():
        big.assign(np.zeros_like(value))
        on_read.assign(np.zeros(2000))
    ckpt.read(path).assert_consumed()
    with group.strategy.scope():
        checks.that(np.array_equal(big.numpy(), value) and np.array_equal(on_read.numpy(), np.arange(2000.0)))
        checks.that(np.array_equal(small.numpy(), values(4, (9,), np.float16)))
    checks.agree(group.comm, f"{big.numpy()[:3]} {sys.byteorder}")


def test_a_restore_into_flat_storage_leaves_values_read_before_it_as_they_were(group, tmp_path):
    """A restore gathers straight into an optimizer's flat buffer; a value read before it (a view of
    that buffer) keeps what it held, as after any write (copy-on-write)."""
    checks = RankChecks()
    directory = shared_dir(group, tmp_path)
    ckpt, _, _ = make_state(group.strategy, shard=False, shapes=LARGE)
    path = ckpt.write(os.path.join(directory, "flat"))
    fresh, fresh_ws, _ = make_state(group.strategy, shard=False, zero=True, shapes=LARGE)
    with group.strategy.scope():
        kept = fresh_ws[0].value()
        before = np.array(kept)
    fresh.read(path).assert_consumed()
    with group.strategy.scope():
        checks.that(np.array_equal(kept, before) and not before.any())
        restored = [w.numpy() for w in fresh_ws]
        checks.that(all(np.array_equal(w, values(k, w.shape)) for k, w in enumerate(restored)))
    checks.agree(group.comm, f"{kept[:3]} {fresh_ws[0].numpy()[:3]}")
