"""Node-local copies of each rank's checkpoint share (``MPISTRAT_LOCAL_COPIES``,
``checkpoint/local_copies.py``): a restore from them once the shared file is gone, from a keeper's
copy where a rank's own is gone, from the shared file where a share has no copy left; what a save
sends for them, counted."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat
from mpistrat.checkpoint import local_copies
from mpistrat.optimizers import Adam
from tests.checkpoint.test_checkpoint import shared_dir
from tests.conftest import WORLD, RankChecks, all_ranks_agree, raises_on_every_rank
from tests.support.counting import CountingComm, Ledger


@pytest.fixture
def local(group, tmp_path, monkeypatch):
    """The group's checkpoint directory, and the one its ranks keep copies in (one node: one)."""
    directory = shared_dir(group, tmp_path)
    where = os.path.join(directory, "node-local")
    monkeypatch.setenv("MPISTRAT_LOCAL_COPIES", where)
    return directory, where


def trained(strategy, rank):
    """Mirrored float32 and float64 variables and sharded Adam slots, two steps on."""
    with strategy.scope():
        w = mpistrat.Variable(np.zeros((5, 7), np.float32), name="w")
        b = mpistrat.Variable(np.zeros(3, np.float64), name="b")
        opt = Adam(0.1, shard_state=True)
    rng = np.random.default_rng(rank)
    for _ in range(2):
        grads = [rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal(3)]
        strategy.run(lambda g=grads: opt.apply_gradients(zip(g, [w, b], strict=True)))
    return w, b, opt, mpistrat.Checkpoint(w=w, b=b, opt=opt)


def state(strategy, w, b, opt):
    with strategy.scope():
        slots = [opt.get_slot(v, n).numpy() for v in (w, b) for n in ("m", "v")]
        return [w.numpy(), b.numpy(), *slots, opt.iterations.numpy()]


def saved_then_changed(group, directory, options=None):
    """A save with its copies, its values, and the variables changed since (one more step)."""
    w, b, opt, ckpt = trained(group.strategy, group.rank)
    path = ckpt.save(os.path.join(directory, "ckpt"), options=options)
    before = state(group.strategy, w, b, opt)
    group.strategy.run(lambda: opt.apply_gradients([(np.ones((5, 7), np.float32), w), (np.ones(3), b)]))
    ckpt.sync()  # a background save: in place, and its copies kept
    return path, before, (w, b, opt, ckpt)


def remove(group, *paths):
    group.comm.Barrier()
    if group.rank == 0:
        for path in paths:
            os.remove(path)
    group.comm.Barrier()


def restored_is(group, before, model, path):
    w, b, opt, ckpt = model
    ckpt.restore(path).assert_consumed()
    after = state(group.strategy, w, b, opt)
    same = all(x.tobytes() == y.tobytes() for x, y in zip(before, after, strict=True))
    all_ranks_agree(group.comm, same, f"restored {after[0][0, :3]} instead of {before[0][0, :3]}")


def copy_of(where, path, rank, kept=False):
    prefix = local_copies._prefix(path)
    return os.path.join(where, f"{prefix}.{rank}" + (".kept" if kept else ""))


@pytest.mark.parametrize("background", [False, True])
def test_a_restore_reads_every_share_from_the_copies_once_the_shared_file_is_gone(
    group, local, background, mpistrat_log
):
    directory, where = local
    options = mpistrat.CheckpointOptions(enable_async=background)
    path, before, model = saved_then_changed(group, directory, options)
    group.comm.Barrier()  # every rank wrote its copies
    names = sorted(os.listdir(where))
    expected = sorted(
        os.path.basename(copy_of(where, path, r, kept)) for r in range(group.size) for kept in (False, True)
    )
    all_ranks_agree(group.comm, names == (expected if group.size > 1 else expected[:1]), str(names))
    remove(group, path)
    restored_is(group, before, model, path)
    said = [m for _, m in mpistrat_log if "read from node-local copies" in m]
    all_ranks_agree(group.comm, len(said) == (WORLD.Get_rank() == 0), str(mpistrat_log))


@pytest.mark.mpi(min_size=2)
def test_a_save_over_every_rank_is_restored_from_its_copies_by_a_rank_alone(world, tmp_path, monkeypatch):
    """A relaunch on fewer ranks: each rank alone restores the whole checkpoint from the copies the
    ranks of the save left in the directory (the file gone)."""
    directory = WORLD.bcast(str(tmp_path) if WORLD.Get_rank() == 0 else None, root=0)
    where = os.path.join(directory, "node-local")
    monkeypatch.setenv("MPISTRAT_LOCAL_COPIES", where)
    path, before, _ = saved_then_changed(world, directory)
    remove(world, path)
    alone = mpistrat.MPIStrategy(MPI.COMM_SELF.Dup())
    with alone.scope():
        w = mpistrat.Variable(np.zeros((5, 7), np.float32), name="w")
        b = mpistrat.Variable(np.zeros(3, np.float64), name="b")
        opt = Adam(0.1, shard_state=True)
    mpistrat.Checkpoint(w=w, b=b, opt=opt).restore(path).assert_consumed()
    after = state(alone, w, b, opt)
    same = all(x.tobytes() == y.tobytes() for x, y in zip(before, after, strict=True))
    all_ranks_agree(WORLD, same, f"restored {after[0][0, :3]} instead of {before[0][0, :3]}")
    alone.experimental_finalize()


def test_a_damaged_copy_is_passed_over_for_the_shared_file(group, local, mpistrat_log):
    """A byte changed in the data of a share's copies: the checksums catch it on every rank, and the
    restore reads the file instead (with the file gone too, it says the file is missing)."""
    directory, where = local
    path, before, model = saved_then_changed(group, directory)
    group.comm.Barrier()
    if group.rank == 0:
        for kept in [False, True] if group.size > 1 else [False]:  # its own copy and its keeper's
            with open(copy_of(where, path, group.size - 1, kept), "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
    restored_is(group, before, model, path)  # from the file
    warned = [m for level, m in mpistrat_log if level == "WARNING" and "reading the file" in m]
    all_ranks_agree(group.comm, len(warned) == (WORLD.Get_rank() == 0), str(mpistrat_log))
    remove(group, path)
    raises_on_every_rank(group.comm, FileNotFoundError, lambda: model[3].restore(path))


def test_a_share_whose_own_copy_is_gone_is_read_from_its_keepers(group, local):
    if group.size == 1:
        pytest.skip("a rank alone has no keeper")
    directory, where = local
    path, before, model = saved_then_changed(group, directory)
    remove(group, path, copy_of(where, path, group.size - 1))
    restored_is(group, before, model, path)


def test_a_share_lost_with_its_keepers_copy_is_read_from_the_shared_file(group, local):
    directory, where = local
    path, before, model = saved_then_changed(group, directory)
    kinds = [False, True] if group.size > 1 else [False]  # its own copy, its keeper's
    remove(group, *[copy_of(where, path, group.size - 1, kept) for kept in kinds])
    restored_is(group, before, model, path)  # from the file
    remove(group, path)  # no copy and no file: it said which it read
    raises_on_every_rank(group.comm, FileNotFoundError, lambda: model[3].restore(path))


def test_a_rank_keeps_only_the_newest_checkpoints_copies(group, local):
    directory, where = local
    *_, ckpt = trained(group.strategy, group.rank)
    ckpt.save(os.path.join(directory, "ckpt"))
    newest = ckpt.save(os.path.join(directory, "ckpt"))
    group.comm.Barrier()
    prefix = local_copies._prefix(newest)
    names = os.listdir(where)
    all_ranks_agree(group.comm, names and all(n.startswith(prefix + ".") for n in names), str(names))


@pytest.mark.mpi(min_size=2)
def test_a_save_sends_its_keeper_one_share_and_nothing_else(tmp_path, monkeypatch):
    """Per save and rank, beside the save's own messages: one handshake (the longest share) and one
    ``Sendrecv`` of this rank's share, padded to the longest (rank 0's, with the file's header),
    which holds its even part of the values every rank holds and its part of the sharded slots."""
    strategy = mpistrat.MPIStrategy(CountingComm(WORLD))
    rank, size = strategy.extended.rank, strategy.num_replicas_in_sync
    directory = WORLD.bcast(str(tmp_path) if rank == 0 else None, root=0)
    *_, ckpt = trained(strategy, rank)
    ledgers = []
    for kept in (None, os.path.join(directory, "node-local")):
        if kept is None:
            monkeypatch.delenv("MPISTRAT_LOCAL_COPIES", raising=False)
        else:
            monkeypatch.setenv("MPISTRAT_LOCAL_COPIES", kept)
        with Ledger.recording() as ledger:
            path = ckpt.save(os.path.join(directory, "ckpt"))
        ledgers.append(ledger)
    with open(path, "rb") as f:  # safetensors: the header's length, then the header
        header = 8 + int.from_bytes(f.read(8), "little")
    data = os.path.getsize(path) - header
    bound = -(-data // size) + 16 * size + header + 4096  # 1/R of the data (and a pack's padding)
    without, with_copies = ledgers
    exchanged = with_copies.only("Sendrecv")
    checks = RankChecks()
    checks.that(exchanged.calls == 1 and exchanged.sent == exchanged.received and 0 < exchanged.sent <= bound)
    checks.that(without.only("Sendrecv").calls == 0 and with_copies.calls == without.calls + 2)
    checks.agree(WORLD, f"{size} ranks: {exchanged.sent} bytes (bound {bound}); {with_copies.log}")
    strategy.experimental_finalize()


def test_copies_that_leave_a_byte_of_the_file_out_or_hold_it_twice_are_not_read():
    """Every share of one save is held, but their ranges must also cover the file once each."""

    def held(rank, *ranges):
        return local_copies.Held(rank, 2, "ckpt.tmp", 100, ranges)

    whole = [[held(0, (0, 60))], [held(1, (60, 40))]]
    assert local_copies._holders(whole) == [(0, whole[0][0]), (1, whole[1][0])]
    assert local_copies._holders([[held(0, (0, 60))], [held(1, (61, 39))]]) is None  # a gap
    assert local_copies._holders([[held(0, (0, 60))], [held(1, (50, 50))]]) is None  # an overlap
    assert local_copies._holders([[held(0, (0, 60))], []]) is None  # a share missing
