"""Checkpoints: round trips at every size, clear errors, atomic saves, and restoring at another size."""

import contextlib
import json
import os
import re
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import mpistrat
import mpistrat.checkpoint.files as checkpoint_files
from mpistrat import ContextError, InvalidArgumentError
from mpistrat.optimizers import SGD
from mpistrat.values import local_variable
from tests.conftest import WORLD, RankChecks, all_ranks_agree, raises_on_every_rank
from tests.support.launch import launcher_options, run_job
from tests.training.test_optimizers import CONFIGS, numpy_reference

ROOT = Path(__file__).resolve().parents[2]


def shared_dir(group, tmp_path):
    """One directory for the whole group: its rank 0's."""
    return group.comm.bcast(str(tmp_path) if group.rank == 0 else None, root=0)


def make_state(group):
    with group.strategy.scope():
        w = mpistrat.Variable(np.arange(3.0), name="w")
        total = mpistrat.Variable(0.0, synchronization="ON_READ", aggregation="SUM")
        mean = mpistrat.Variable(0.0, synchronization="ON_READ", aggregation="MEAN")
        step = mpistrat.Variable(np.int64(0))
        opt = SGD(0.5, momentum=0.9)
    return w, total, mean, step, opt


@pytest.mark.parametrize("aggregation", ["SUM", "MEAN", "ONLY_FIRST_REPLICA"])
def test_trainable_sync_on_read_variable(group, tmp_path, aggregation):
    # tf 2.21: tf.Variable(1.0, synchronization=ON_READ, aggregation=..., trainable=True) is accepted
    # and trainable (only Keras's add_weight refuses it). Replica r assigns r + 1; tf.train.Checkpoint
    # saves the aggregate: SUM n(n+1)/2 (3.0 at 2), MEAN (n+1)/2 (1.5), ONLY_FIRST_REPLICA 1.0. After
    # assign(100.0) in cross-replica context and a restore, every copy holds SUM: the sum / n (1.5 at
    # 2), MEAN: the mean (1.5), ONLY_FIRST_REPLICA: 1.0, and reading gives the saved value again
    directory, n = shared_dir(group, tmp_path), group.size
    with group.strategy.scope():
        v = mpistrat.Variable(
            np.float32(1.0), synchronization="ON_READ", aggregation=aggregation, trainable=True, name="v"
        )
    group.strategy.run(
        lambda: v.assign(np.float32(mpistrat.get_replica_context().replica_id_in_sync_group + 1))
    )
    saved = {"SUM": n * (n + 1) / 2, "MEAN": (n + 1) / 2, "ONLY_FIRST_REPLICA": 1.0}[aggregation]
    copy = {"SUM": saved / n, "MEAN": saved, "ONLY_FIRST_REPLICA": 1.0}[aggregation]
    ckpt = mpistrat.Checkpoint(v=v)
    with group.strategy.scope():
        before = float(v.read_value())
        path = ckpt.save(os.path.join(directory, "ckpt"))
        v.assign(np.float32(100.0))
        ckpt.restore(path)
        after = float(v.read_value())
    mine = float(group.strategy.run(v.read_value))
    got = (v.trainable, v.dtype, before, after, mine)
    all_ranks_agree(group.comm, got == (True, np.float32, saved, saved, copy), f"{got}")


def test_round_trip(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    w, total, mean, step, opt = make_state(group)

    def train():
        rid = mpistrat.get_replica_context().replica_id_in_sync_group
        opt.apply_gradients([(np.ones(3), w)])
        total.assign_add(rid + 1.0)
        mean.assign_add(rid + 1.0)

    group.strategy.run(train)
    ckpt = mpistrat.Checkpoint(model={"w": w}, optimizer=opt, step=step, stats=[total, mean])
    with group.strategy.scope():
        step.assign(7)
        expected = [w.numpy(), float(total.numpy()), float(mean.numpy()), opt.get_slot(w, "momentum").numpy()]
        path = ckpt.save(os.path.join(directory, "ckpt"))
        for var in (w, total, mean, opt.get_slot(w, "momentum"), ckpt.save_counter):
            var.assign(np.zeros(var.shape, var.dtype))
        step.assign(0)
        latest = mpistrat.latest_checkpoint(directory)
        ckpt.restore(latest).assert_consumed()
        got = [w.numpy(), float(total.numpy()), float(mean.numpy()), opt.get_slot(w, "momentum").numpy()]
        iterations, step_value = int(opt.iterations.numpy()), int(step.numpy())
    n = group.size
    checks = RankChecks()
    checks.that(latest == path == os.path.join(directory, "ckpt-1") and int(ckpt.save_counter) == 1)
    checks.that(step_value == 7 and iterations == 1)
    checks.that(expected[1] == n * (n + 1) / 2 and expected[2] == (n + 1) / 2)
    checks.that(all(np.allclose(g, e) for g, e in zip(got, expected, strict=True)))
    checks.agree(group.comm, f"{got} != {expected}")


def test_restore_creates_optimizer_slots(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    w, _, _, _, opt = make_state(group)
    group.strategy.run(lambda: opt.apply_gradients([(np.ones(3), w)]))
    mpistrat.Checkpoint(w=w, opt=opt).write(os.path.join(directory, "a"))
    w2, _, _, _, fresh = make_state(group)
    mpistrat.Checkpoint(w=w2, opt=fresh).restore(os.path.join(directory, "a"))
    slot = fresh.get_slot(w2, "momentum")
    ok = np.allclose(slot.numpy(), -0.5 * group.size) and int(fresh.iterations.numpy()) == 1
    all_ranks_agree(group.comm, ok and np.allclose(w2.numpy(), w.numpy()), repr(slot))


def test_mismatched_entries_are_an_error_and_nothing_is_assigned(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        a, c = mpistrat.Variable(np.zeros(2)), mpistrat.Variable(np.int64(3))
    path = mpistrat.Checkpoint(a=a, c=c).write(os.path.join(directory, "ab"))
    with group.strategy.scope():
        wrong, b = mpistrat.Variable(np.zeros(3)), mpistrat.Variable(1.0)
        c.assign(0)
    message = raises_on_every_rank(
        group.comm, InvalidArgumentError, lambda: mpistrat.Checkpoint(a=wrong, b=b, c=c).restore(path)
    )
    assert message.endswith("different shape or dtype: a (checkpoint: float64[2], here: float64[3])")
    assert int(c.numpy()) == 0 and float(b.numpy()) == 1.0 and wrong.numpy().tolist() == [0.0] * 3


def test_restore_is_partial_unless_asked_to_be_strict(group, tmp_path, mpistrat_log):
    """tf's CheckpointLoadStatus: restore assigns what matches; assert_consumed() and
    assert_existing_objects_matched() raise AssertionError naming what did not."""
    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        a, c = mpistrat.Variable(np.ones(2)), mpistrat.Variable(np.int64(3))
    path = mpistrat.Checkpoint(a=a, c=c).write(os.path.join(directory, "ac"))
    with group.strategy.scope():
        b = mpistrat.Variable(1.0)
        c.assign(0)
    # b is tracked but not in the file; a is in the file but not tracked: c is restored anyway.
    status = mpistrat.Checkpoint(b=b, c=c).restore(path)
    with pytest.raises(AssertionError, match=r"no value in the checkpoint .*: b$"):
        status.assert_existing_objects_matched()
    with pytest.raises(AssertionError, match="no value in the checkpoint"):
        status.assert_consumed()
    assert int(c.numpy()) == 3 and float(b.numpy()) == 1.0
    status.expect_partial()
    # Only unused values: the tracked objects all matched, but not everything was consumed.
    status = mpistrat.Checkpoint(c=c).restore(path)
    assert status.assert_existing_objects_matched() is status
    with pytest.raises(AssertionError, match=r"nothing here tracks: a$"):
        status.assert_consumed()
    assert mpistrat.Checkpoint(a=a, c=c).restore(path).assert_consumed() is not None
    # tf warns about unused values when the status goes away, unless expect_partial() was called.
    del status
    assert mpistrat.Checkpoint(c=c).restore(path).expect_partial() is not None
    warnings = [m for level, m in mpistrat_log if level == "WARNING"]
    if WORLD.Get_rank() == 0:  # the group's rank 0, whose warnings the logger lets through
        assert len(warnings) == 1 and "nothing here tracks were not restored: a" in warnings[0], warnings


def test_restore_of_none_restores_nothing(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    ckpt = mpistrat.Checkpoint(v=make_state(group)[0])
    status = ckpt.restore(None)
    # tf's InitializationOnlyStatus: nothing to assert about, expect_partial() is harmless.
    assert status.expect_partial() is status
    with pytest.raises(AssertionError, match=re.escape("No checkpoint specified (save_path=None)")):
        status.assert_consumed()
    with group.strategy.scope():
        assert mpistrat.latest_checkpoint(directory) is None
    assert mpistrat.latest_checkpoint(os.path.join(directory, "no such directory")) is None


def test_a_rank_without_a_checkpoint_fails_every_rank(group, tmp_path):
    if group.size == 1:
        pytest.skip("needs two ranks to disagree")
    directory = shared_dir(group, tmp_path)
    ckpt = mpistrat.Checkpoint(v=make_state(group)[0])
    path = ckpt.write(os.path.join(directory, "c"))
    raises_on_every_rank(
        group.comm, mpistrat.CollectiveMismatchError, lambda: ckpt.restore(path if group.rank == 0 else None)
    )


def test_interrupted_save_keeps_the_previous_checkpoint(group, tmp_path, monkeypatch):
    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        v = mpistrat.Variable(np.arange(4.0))
    ckpt = mpistrat.Checkpoint(v=v)
    prefix = os.path.join(directory, "ckpt")
    path = ckpt.save(prefix)
    fixed = ckpt.write(os.path.join(directory, "fixed"))

    def crash(tmp, target):
        assert os.path.getsize(tmp) > 0
        raise OSError("no space left on device (simulated)")

    monkeypatch.setattr(checkpoint_files, "_before_rename", crash)
    with group.strategy.scope():
        v.assign(np.full(4, -1.0))
    raises_on_every_rank(group.comm, OSError, lambda: ckpt.save(prefix), "simulated")
    raises_on_every_rank(group.comm, OSError, lambda: ckpt.write(fixed), "simulated")
    monkeypatch.undo()
    with group.strategy.scope():
        latest = mpistrat.latest_checkpoint(directory)
    for good in (latest, fixed):  # the numbered one and the one a write would have replaced
        with group.strategy.scope():
            v.assign(np.full(4, -1.0))
        ckpt.restore(good).assert_consumed()
        all_ranks_agree(group.comm, v.numpy().tolist() == [0, 1, 2, 3], f"{good}: {v!r}")
    files = sorted(os.listdir(directory))
    # The failed save did not count: the next one is ckpt-2 again.
    ok = latest == path and int(ckpt.save_counter) == 1 and files == ["checkpoint", "ckpt-1", "fixed"]
    all_ranks_agree(group.comm, ok, f"{latest} {int(ckpt.save_counter)} {files}")


def test_a_replaced_file_keeps_a_name_until_its_replacement_is_durable(group, tmp_path, monkeypatch):
    """The folder's fsync after the rename frees nothing (a file system that discards freed blocks
    would do it then): the file replaced still has a name, removed once the rename is durable."""
    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        v = mpistrat.Variable(np.arange(4, dtype=np.float32))
    ckpt = mpistrat.Checkpoint(v=v)
    path = ckpt.write(os.path.join(directory, "model"))
    replaced = os.stat(path).st_ino
    seen: list[set[int]] = []  # the folder's inodes at each fsync of a folder
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            seen.append({entry.inode() for entry in os.scandir(directory)})
        real_fsync(fd)

    monkeypatch.setattr(checkpoint_files.os, "fsync", fsync)
    with group.strategy.scope():
        v.assign(np.full(4, 7, np.float32))
    ckpt.write(path)
    monkeypatch.undo()
    with group.strategy.scope():
        v.assign(np.zeros(4, np.float32))
    ckpt.read(path).assert_consumed()
    if group.rank == 0:  # rank 0 renames
        ok = bool(seen) and replaced in seen[-1] and os.stat(path).st_ino != replaced
        ok = ok and os.listdir(directory) == ["model"]
    else:
        ok = not seen
    all_ranks_agree(group.comm, ok and v.numpy().tolist() == [7] * 4, f"{seen} {os.listdir(directory)} {v!r}")


@contextlib.contextmanager
def removals_held(monkeypatch):
    """Within the block every file counts as large, and the removal of its second name waits until
    the block ends (a save that waited for it fails); then the removals finish."""
    returned, real_remove = threading.Event(), os.remove

    def remove(name, *args, **kwargs):
        if ".replaced.tmp" in str(name):
            assert returned.wait(60), "the save waited for the removal"
        real_remove(name, *args, **kwargs)

    monkeypatch.setattr(checkpoint_files, "_REMOVED_BESIDE", 0)
    monkeypatch.setattr(checkpoint_files.os, "remove", remove)
    try:
        yield
    finally:
        returned.set()
        checkpoint_files.wait_for_removals()
        monkeypatch.undo()


def test_a_large_replaced_file_is_removed_after_the_save_returns(group, tmp_path, monkeypatch):
    """The kernel drops a removed file's cached pages as it goes: for a large file a thread does it,
    and the save returns without waiting (here the removal waits until the save has returned)."""
    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        v = mpistrat.Variable(np.arange(4, dtype=np.float32))
    ckpt = mpistrat.Checkpoint(v=v)
    path = ckpt.write(os.path.join(directory, "model"))
    with group.strategy.scope():
        v.assign(np.full(4, 7, np.float32))
    with removals_held(monkeypatch):
        ckpt.write(path)
        during = sorted(os.listdir(directory))
    with group.strategy.scope():
        v.assign(np.zeros(4, np.float32))
    ckpt.read(path).assert_consumed()
    ok = v.numpy().tolist() == [7] * 4 and os.listdir(directory) == ["model"]
    if group.rank == 0:  # rank 0 renames, and removes the replaced file's second name
        ok = ok and len(during) == 2 and "model" in during
    all_ranks_agree(group.comm, ok, f"during: {during}; after: {os.listdir(directory)}; {v!r}")


SAVE_TWICE_AND_EXIT = """
import os, sys, time
import numpy as np
import mpistrat

remove = os.remove
def slow_remove(name, *args, **kwargs):  # the replaced file's removal outlasts the program
    if ".replaced.tmp" in str(name):
        time.sleep(1.0)
    remove(name, *args, **kwargs)
os.remove = slow_remove

strategy = mpistrat.MPIStrategy()
with strategy.scope():
    v = mpistrat.Variable(np.arange(5 << 20, dtype=np.float32))  # 20 MiB: removed by a thread
ckpt = mpistrat.Checkpoint(v=v)
ckpt.write(sys.argv[1] + "/model")
with strategy.scope():
    v.assign_add(np.ones(5 << 20, np.float32))
ckpt.write(sys.argv[1] + "/model")
print("written", flush=True)
"""


@pytest.mark.serial
def test_a_job_that_ends_right_after_replacing_a_large_file_leaves_only_the_new_one(tmp_path):
    script, folder = tmp_path / "job.py", tmp_path / "files"
    script.write_text(SAVE_TWICE_AND_EXIT)
    folder.mkdir()
    code, out = run_job(script, str(folder), ranks=3, limit=60)
    assert code == 0 and "written" in out, out
    assert os.listdir(folder) == ["model"]
    v = mpistrat.Variable(np.zeros(5 << 20, np.float32))
    mpistrat.Checkpoint(v=v).read(str(folder / "model")).assert_consumed()
    assert np.array_equal(v.numpy(), np.arange(5 << 20, dtype=np.float32) + 1)


def test_a_save_killed_while_the_replaced_file_has_two_names_leaves_nothing_after_the_next(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    ckpt = mpistrat.Checkpoint(v=make_state(group)[0])
    path = ckpt.write(os.path.join(directory, "model"))
    if group.rank == 0:  # the second name a process gave the file before it died
        second = checkpoint_files._second_name(path)
        assert second is not None
        dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process can have it
        os.rename(second, second.replace(f".tmp{os.getpid()}-", f".tmp{dead}-"))
    group.comm.Barrier()
    left = sorted(os.listdir(directory))
    ckpt.write(path)
    ok = len(left) == 2 and sorted(os.listdir(directory)) == ["model"]
    all_ranks_agree(group.comm, ok, f"after the killed save: {left}; after the next: {os.listdir(directory)}")


def test_a_file_system_without_hard_links_replaces_the_file_all_the_same(group, tmp_path, monkeypatch):
    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        v = mpistrat.Variable(np.arange(4, dtype=np.float32))
    ckpt = mpistrat.Checkpoint(v=v)
    path = ckpt.write(os.path.join(directory, "model"))

    def no_links(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted (simulated)")

    monkeypatch.setattr(checkpoint_files.os, "link", no_links)
    with group.strategy.scope():
        v.assign(np.full(4, 3, np.float32))
    ckpt.write(path)
    monkeypatch.undo()
    with group.strategy.scope():
        v.assign(np.zeros(4, np.float32))
    ckpt.read(path).assert_consumed()
    ok = v.numpy().tolist() == [3] * 4 and os.listdir(directory) == ["model"]
    all_ranks_agree(group.comm, ok, f"{v!r} {os.listdir(directory)}")


def test_reading_errors_reach_every_rank(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    ckpt = mpistrat.Checkpoint(v=make_state(group)[0])
    raises_on_every_rank(group.comm, FileNotFoundError, lambda: ckpt.restore(os.path.join(directory, "nope")))
    raises_on_every_rank(group.comm, FileNotFoundError, lambda: ckpt.read(os.path.join(directory, "nope")))
    if group.rank == 0:
        np.savez(os.path.join(directory, "foreign.npz"), v=np.zeros(3))
    group.comm.Barrier()
    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: ckpt.restore(os.path.join(directory, "foreign.npz")),
        "not an mpistrat checkpoint",
    )
    with group.strategy.scope():
        assert mpistrat.latest_checkpoint(directory) is None


def corrupt_copies(data):
    """(name, bytes) of ``data`` truncated at several lengths and with one byte flipped at many places."""
    cuts = sorted({0, 1, 4, 30, len(data) // 2, len(data) - 22, len(data) - 1})
    yield from ((f"cut{n}", data[:n]) for n in cuts)
    for i in range(0, len(data), 3):
        flipped = bytearray(data)
        flipped[i] ^= 0xFF
        yield f"flip{i}", bytes(flipped)


def test_corrupt_files_raise_one_clear_error_on_every_rank(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        v = mpistrat.Variable(np.arange(4.0))
    ckpt = mpistrat.Checkpoint(v=v)
    path = ckpt.write(os.path.join(directory, "good"))
    names = []
    if group.rank == 0:
        data = Path(path).read_bytes()
        for name, content in corrupt_copies(data):
            Path(directory, name).write_bytes(content)
            names.append(name)
    names = group.comm.bcast(names, root=0)
    bad, detected = [], 0
    for name in names:
        target = os.path.join(directory, name)
        with group.strategy.scope():
            v.assign(np.full(4, -1.0))
        try:
            ckpt.restore(target)
        except InvalidArgumentError as exc:
            detected += 1
            if target not in str(exc) or (
                "truncated or corrupt" not in str(exc) and "not an mpistrat" not in str(exc)
            ):
                bad.append(f"{name}: unclear message {exc}")
        except BaseException as exc:  # a raw zipfile/NumPy/OS error is the bug
            bad.append(f"{name}: {type(exc).__name__}: {exc}")
        else:  # damage zip does not check (a timestamp, a comment length): the values must be intact
            if v.numpy().tolist() != [0.0, 1.0, 2.0, 3.0]:
                bad.append(f"{name}: restored wrong values {v.numpy()}")
    all_ranks_agree(group.comm, not bad and detected > len(names) // 2, f"{detected}/{len(names)}: {bad[:5]}")


def test_restore_of_a_missing_file_is_still_file_not_found(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    ckpt = mpistrat.Checkpoint(v=make_state(group)[0])
    raises_on_every_rank(group.comm, FileNotFoundError, lambda: ckpt.restore(os.path.join(directory, "none")))


DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON that Python's parser cannot follow (RecursionError)


def deeply_nested_file():
    """A file shaped like a checkpoint (an 8-byte length, then the JSON header) nested 100,000 deep."""
    return struct.pack("<Q", len(DEEP)) + DEEP.encode()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "nested deep", "names a deleted file"])
def test_latest_falls_back_to_the_newest_valid_file_when_the_index_is_unreadable(
    group, tmp_path, damage, mpistrat_log
):
    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        v = mpistrat.Variable(np.arange(4.0))
    ckpt = mpistrat.Checkpoint(v=v)
    for _ in range(3):
        ckpt.save(os.path.join(directory, "ckpt"))
    if group.rank == 0:
        now = time.time()
        index = Path(directory, checkpoint_files.INDEX)
        for age, name in ((300, "ckpt-1"), (200, "ckpt-2"), (100, "ckpt-3")):
            os.utime(Path(directory, name), (now - age, now - age))
        # Newer than the valid ones, but not valid checkpoints of ours: all must be skipped.
        Path(directory, "ckpt-4").write_bytes(Path(directory, "ckpt-3").read_bytes()[:-30])  # truncated
        np.savez(Path(directory, "foreign.npz"), v=np.zeros(4))
        Path(directory, "notes.txt").write_text("not a checkpoint")
        Path(directory, "ckpt-5.tmp123-host").write_bytes(Path(directory, "ckpt-3").read_bytes())
        Path(directory, "ckpt-6").write_bytes(deeply_nested_file())
        text = index.read_text()
        if damage == "truncated":
            index.write_text(text[: len(text) // 2])
        elif damage == "garbage":
            index.write_bytes(b"\x00\xff" * 8)
        elif damage == "empty":
            index.write_text("")
        elif damage == "nested deep":
            index.write_text(DEEP)
        else:
            os.remove(Path(directory, "ckpt-3"))
        for name in ("ckpt-4", "foreign.npz", "notes.txt", "ckpt-5.tmp123-host", "ckpt-6"):
            os.utime(Path(directory, name), (now, now))
    group.comm.Barrier()
    want = os.path.join(directory, "ckpt-2" if damage == "names a deleted file" else "ckpt-3")
    with group.strategy.scope():
        got = mpistrat.latest_checkpoint(directory)
    all_ranks_agree(group.comm, got == want, f"{got} != {want}")
    if WORLD.Get_rank() == 0:  # the group's rank 0, whose warnings the logger lets through
        warnings = [m for level, m in mpistrat_log if level == "WARNING" and "index" in m]
        assert len(warnings) == 1 and want in warnings[0], mpistrat_log


def test_latest_without_an_index_is_still_none(group, tmp_path, mpistrat_log):
    directory = shared_dir(group, tmp_path)
    ckpt = mpistrat.Checkpoint(v=make_state(group)[0])
    ckpt.save(os.path.join(directory, "ckpt"))
    if group.rank == 0:
        os.remove(os.path.join(directory, checkpoint_files.INDEX))
    group.comm.Barrier()
    with group.strategy.scope():
        assert mpistrat.latest_checkpoint(directory) is None
    assert not [m for lv, m in mpistrat_log if lv == "WARNING"]


@pytest.mark.parametrize(
    ("dtype", "background"), [(np.float32, False), (np.float64, False), (np.float32, True)]
)
def test_a_mirrored_variable_whose_copies_differ_is_refused_on_every_rank_and_nothing_is_written(
    group, tmp_path, dtype, background
):
    """tf's MirroredVariableSaveRestoreTest sets the copies to 3.0 and 4.0 and restores the first
    replica's value; here each rank writes its share from its own copy, so the file would mix them:
    the ranks compare their copies' checksums and refuse the file, naming the variable (a background
    save at its end: at ``sync()``). With the check off they are not compared (the file then holds
    each rank's share of its own copy)."""
    if group.size == 1:
        pytest.skip("needs two copies to differ")
    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        v = mpistrat.Variable(np.zeros(1000, dtype), name="v")
        same = mpistrat.Variable(np.ones(3, dtype), name="same")
        seen = mpistrat.Variable(0.0, synchronization="ON_READ", aggregation="SUM", name="seen")
    group.strategy.run(lambda: seen.assign_add(mpistrat.get_replica_context().replica_id_in_sync_group + 1.0))
    local_variable(v).assign(np.full(1000, 3.0 if group.rank < group.size - 1 else 4.0, dtype))
    ckpt = mpistrat.Checkpoint(model={"v": v, "same": same}, seen=seen)
    options = mpistrat.CheckpointOptions(enable_async=background)
    message = raises_on_every_rank(
        group.comm,
        mpistrat.CollectiveMismatchError,
        lambda: (ckpt.save(os.path.join(directory, "ckpt"), options), ckpt.sync()),
        "the ranks' copies of a value every rank holds differ",
    )
    left = group.comm.bcast(sorted(os.listdir(directory)) if group.rank == 0 else None)
    checks = RankChecks()
    checks.that("'model/v'" in message and "'model/same'" not in message and left == [])
    checks.that(background or int(ckpt.save_counter.numpy()) == 0)
    checks.agree(group.comm, f"{left}: {message}")
    unchecked = mpistrat.MPIStrategy(
        group.comm, communication_options=mpistrat.CommunicationOptions(check=False)
    )
    try:
        with unchecked.scope():
            w = mpistrat.Variable(np.zeros(4, dtype), name="w")
        local_variable(w).assign(np.full(4, group.rank, dtype))
        with unchecked.scope():
            path = mpistrat.Checkpoint(w=w).write(os.path.join(directory, "unchecked"))
        all_ranks_agree(group.comm, os.path.exists(path), "the save with the check off was refused")
    finally:
        unchecked.experimental_finalize()


@pytest.mark.timeout(60)  # before the hints were agreed on, MPI.File.Open waited forever
def test_mpi_io_hints_that_differ_between_ranks_are_an_error_on_every_rank_not_a_hang(
    group, tmp_path, monkeypatch
):
    if group.size == 1:
        pytest.skip("needs two ranks to differ")
    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        w = mpistrat.Variable(np.arange(4.0), name="w")
    ckpt = mpistrat.Checkpoint(w=w)
    path = os.path.join(directory, "good")
    with monkeypatch.context() as patched:
        if group.rank == group.size - 1:
            patched.setenv("MPISTRAT_IO_HINTS", "romio_cb_write=enable")
        save = lambda: ckpt.save(os.path.join(directory, "ckpt"))  # noqa: E731
        raises_on_every_rank(group.comm, mpistrat.CollectiveMismatchError, save, "leaf MPI-IO hints")
    ckpt.write(path)
    with monkeypatch.context() as patched:
        if group.rank == group.size - 1:
            patched.setenv("MPISTRAT_IO_HINTS", "romio_cb_write=enable")
        restore = lambda: ckpt.restore(path)  # noqa: E731
        raises_on_every_rank(group.comm, mpistrat.CollectiveMismatchError, restore, "leaf MPI-IO hints")
    options = mpistrat.CheckpointOptions(io_hints={"cb_nodes": "1"}) if group.rank == 0 else None
    for call in (lambda: ckpt.read(path, options), lambda: ckpt.write(os.path.join(directory, "x"), options)):
        raises_on_every_rank(group.comm, mpistrat.CollectiveMismatchError, call, "leaf MPI-IO hints")
    with group.strategy.scope():
        w.assign(np.zeros(4))
    ckpt.restore(path).assert_consumed()  # the same hints everywhere: as before
    with group.strategy.scope():
        ok = w.numpy().tolist() == [0.0, 1.0, 2.0, 3.0] and int(ckpt.save_counter.numpy()) == 0
    left = group.comm.bcast(sorted(os.listdir(directory)) if group.rank == 0 else None)
    all_ranks_agree(group.comm, ok and left == ["good"], f"{w!r} {left}")


@pytest.mark.timeout(60)  # a FIFO opened for reading waits for a writer
def test_restoring_a_fifo_says_it_is_not_a_file_on_every_rank(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    fifo = os.path.join(directory, "ckpt-1")
    if group.rank == 0:
        os.mkfifo(fifo)
    group.comm.Barrier()
    ckpt = mpistrat.Checkpoint(v=make_state(group)[0])
    message = raises_on_every_rank(group.comm, InvalidArgumentError, lambda: ckpt.restore(fifo), "is a FIFO")
    all_ranks_agree(group.comm, fifo in message and "not a regular file" in message, message)


def test_save_removes_only_stale_temporaries_of_its_own(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    ckpt = mpistrat.Checkpoint(v=make_state(group)[0])
    ckpt.save(os.path.join(directory, "ckpt"))  # ckpt-1
    host = checkpoint_files._host()
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process can have it
    alive = os.getppid()
    old = time.time() - 2 * checkpoint_files._STALE_AFTER
    # What saves write (format 2, safetensors), what earlier versions wrote (format 1, a zip), the index.
    npz, index = Path(directory, "ckpt-1").read_bytes(), b'{"latest": "x"}'
    zipped = b"PK\x03\x04" + bytes(60)
    files = {  # name: (content, old?, removed?)
        f"ckpt.tmp{dead}-{host}": (npz, False, True),  # a killed save on this host
        f"ckpt-7.tmp{dead}-{host}": (zipped, False, True),  # an earlier version's killed save
        f"checkpoint.tmp{dead}-{host}": (index, False, True),  # the index's
        f"ckpt-9.tmp{dead}-{host}": (npz[:9], False, True),  # killed early in the write (its header)
        f"ckpt.tmp{alive}-{host}": (npz, False, False),  # another job saving now, on this host
        f"ckpt.tmp-{dead}": (npz, True, False),  # not our naming
        f"ckpt.tmp{dead}-": (npz, True, False),  # nor this
        f"ckpt.tmp{dead}-elsewhere.example": (npz, False, False),  # maybe saving now, on another host
        f"ckpt-2.tmp{dead}-elsewhere.example": (npz, True, True),  # long abandoned there
        f"ckpt.tmp{dead}": (npz, True, False),  # no host: a name anyone may choose ("run.tmp1")
        f"ckpt.tmp{dead}-2": (npz, True, False),  # a host without a letter: a save's "<prefix>-2"
        f"ckpt-6.tmp{dead}-elsewhere.example": (npz, True, False),  # listed in the index: a checkpoint
        f"notes.tmp{dead}-{host}": (b"my notes", True, False),  # our naming, not our content
        f"empty.tmp{dead}-{host}": (b"", True, False),  # nothing to reclaim, maybe not ours
        "data.bin": (npz, True, False),
    }
    if group.rank == 0:
        for name, (content, is_old, _) in files.items():
            Path(directory, name).write_bytes(content)
            if is_old:
                os.utime(Path(directory, name), (old, old))
        checkpoint_files.write_index(directory, ["ckpt-1", f"ckpt-6.tmp{dead}-elsewhere.example"])
    group.comm.Barrier()
    ckpt.save(os.path.join(directory, "ckpt"))  # ckpt-2
    present = set(os.listdir(directory))
    wrong = [name for name, (_, _, removed) in files.items() if (name in present) == removed]
    ok = not wrong and {"ckpt-1", "ckpt-2", checkpoint_files.INDEX} <= present
    all_ranks_agree(group.comm, ok, f"wrongly kept or removed: {wrong}")
    with group.strategy.scope():
        assert mpistrat.latest_checkpoint(directory) == os.path.join(directory, "ckpt-2")


def test_ranks_in_different_checkpoint_calls_fail_instead_of_hanging(group, tmp_path):
    if group.size == 1:
        pytest.skip("needs two ranks to disagree")
    directory = shared_dir(group, tmp_path)
    ckpt = mpistrat.Checkpoint(v=make_state(group)[0])
    call = (
        (lambda: mpistrat.latest_checkpoint(directory))
        if group.rank == 0
        else (lambda: ckpt.save(f"{directory}/c"))
    )

    def in_scope():
        with group.strategy.scope():
            call()

    raises_on_every_rank(group.comm, mpistrat.CollectiveMismatchError, in_scope, "different collectives")


def test_context_and_argument_rules(world, tmp_path):
    w, _, _, _, opt = make_state(world)
    ckpt = mpistrat.Checkpoint(w=w)
    with pytest.raises(ContextError, match="cross-replica"):
        world.strategy.run(lambda: ckpt.save(str(tmp_path / "x")))
    with pytest.raises(InvalidArgumentError, match="expected a Variable"):
        mpistrat.Checkpoint(w="not a variable")
    with pytest.raises(InvalidArgumentError, match=r"w/1 must be a Variable"):
        mpistrat.Checkpoint(w=[w, "not a variable"])
    with pytest.raises(InvalidArgumentError, match="reserved"):
        mpistrat.Checkpoint(__mpistrat__=w)
    with pytest.raises(InvalidArgumentError, match="reserved"):
        mpistrat.Checkpoint(save_counter=w)
    with pytest.raises(InvalidArgumentError, match="track: expected a Variable; got float"):
        ckpt.track("x", 3.0)
    world.strategy.run(lambda: opt.apply_gradients([(np.ones(3), w)]))
    with pytest.raises(InvalidArgumentError, match="does not track"):
        mpistrat.Checkpoint(opt=opt).save(str(tmp_path / "y"))
    with pytest.raises(InvalidArgumentError, match="index file"):
        ckpt.write(str(tmp_path / "checkpoint"))
    with pytest.raises(InvalidArgumentError, match="got None"):
        ckpt.read(None)
    with pytest.raises(ContextError, match="cross-replica"):
        world.strategy.run(lambda: mpistrat.latest_checkpoint(str(tmp_path)))


# -- separate jobs (serial pass only) --------------------------------------------------------


def child_env():
    """This environment without the variables of the MPI job pytest may itself be part of."""
    prefixes = ("PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "MPICH_INTERFACE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def mpiexec(n, *args):
    launcher = [str(Path(sys.executable).parent / "mpiexec"), *launcher_options()]
    cmd = [
        *launcher,
        "-n",
        str(n),
        sys.executable,
        str(ROOT / "tests" / "checkpoint" / "checkpoint_job.py"),
        *args,
    ]
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.serial
def test_save_on_two_ranks_restore_on_three(tmp_path):
    mpiexec(2, "save", str(tmp_path), "4")
    assert os.listdir(tmp_path) and (tmp_path / "ckpt-4").is_file()
    mpiexec(3, "restore", str(tmp_path), "3", str(tmp_path / "out.json"))
    report = json.loads((tmp_path / "out.json").read_text())
    cfg = CONFIGS["adam"][1]
    after_save = numpy_reference(cfg, lambda k: cfg["lr"], steps=4)
    final_w, final_b = numpy_reference(cfg, lambda k: cfg["lr"], steps=7)
    restored = report["restored"]
    assert restored["path"] == str(tmp_path / "ckpt-4") and restored["iterations"] == 4
    assert np.allclose(restored["w"], after_save[0], rtol=1e-10) and restored["seen"] == 40.0
    assert report["ranks"] == 3 and report["step"] == 7 and report["iterations"] == 7
    assert np.allclose(report["w"], final_w, rtol=1e-10) and np.isclose(report["b"], final_b, rtol=1e-10)
    assert report["seen"] == 70.0


@pytest.mark.serial
@pytest.mark.parametrize(
    "saved,restored",
    [((2, True), (3, False)), ((3, False), (2, True)), ((4, True), (3, True)), ((3, True), (1, False))],
    ids=["2-sharded-to-3", "3-to-2-sharded", "4-sharded-to-3-sharded", "3-sharded-to-1"],
)
def test_checkpoints_cross_sharding_and_rank_counts(tmp_path, saved, restored):
    """A checkpoint does not depend on shard_state or R: weights and every slot come back bitwise,
    and training goes on to the serial reference."""
    (n_save, shard_save), (n_restore, shard_restore) = saved, restored
    mpiexec(n_save, "save", str(tmp_path), "4", str(tmp_path / "saved.json"), *(["--shard"] * shard_save))
    mpiexec(
        n_restore, "restore", str(tmp_path), "3", str(tmp_path / "out.json"), *(["--shard"] * shard_restore)
    )
    before = json.loads((tmp_path / "saved.json").read_text())
    report = json.loads((tmp_path / "out.json").read_text())
    restored_state = report["restored"]
    assert restored_state["w"] == before["w"] and restored_state["b"] == before["b"]
    assert restored_state["slots"] == before["slots"] and restored_state["iterations"] == 4
    cfg = CONFIGS["adam"][1]
    final_w, final_b = numpy_reference(cfg, lambda k: cfg["lr"], steps=7)
    assert np.allclose(report["w"], final_w, rtol=1e-10) and np.isclose(report["b"], final_b, rtol=1e-10)


KILLED_SAVE = """
import sys, time
import numpy as np
import mpistrat, mpistrat.checkpoint.files as ck

directory = sys.argv[1]
v = mpistrat.Variable(np.arange(4.0))
ckpt = mpistrat.Checkpoint(v=v)
ckpt.save(directory + "/ckpt")
v.assign(np.full(4, -1.0))

def hang(tmp, path):
    if path.endswith("ckpt-2"):
        print("WRITTEN", tmp, flush=True)
        time.sleep(100)

ck._before_rename = hang
ckpt.save(directory + "/ckpt")
"""


@pytest.mark.serial
def test_killed_save_leaves_the_old_checkpoint_loadable(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(tmp_path)], env=child_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "WRITTEN", f"the job ended before the hook: {line}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert Path(line[1]).is_file()  # the new checkpoint was written, never renamed
    v = mpistrat.Variable(np.zeros(4))
    ckpt = mpistrat.Checkpoint(v=v)
    assert mpistrat.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-1")
    ckpt.restore(mpistrat.latest_checkpoint(tmp_path)).assert_consumed()
    assert v.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
    # The restored save_counter numbers the next save, which reclaims the killed one's temporary file.
    assert ckpt.save(tmp_path / "ckpt") == str(tmp_path / "ckpt-2")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-1", "ckpt-2"]


def test_a_manager_whose_name_ends_like_a_temporary_keeps_its_checkpoints(group, tmp_path):
    """checkpoint_name="exp.tmp2025" names files exp.tmp2025-1, -2: checkpoints, however old, not the
    temporaries of a killed save on a host named "1" (which earlier versions took them for)."""
    directory = shared_dir(group, tmp_path)
    ckpt = mpistrat.Checkpoint(v=make_state(group)[0])
    manager = mpistrat.CheckpointManager(ckpt, directory, max_to_keep=None, checkpoint_name="exp.tmp2025")
    first, second = manager.save(), manager.save()
    if group.rank == 0:
        old = time.time() - 2 * 3600
        for path in (first, second):
            os.utime(path, (old, old))
    group.comm.Barrier()
    third = manager.save()
    present = group.comm.bcast(sorted(os.listdir(directory)) if group.rank == 0 else None)
    want = ["checkpoint", "exp.tmp2025-1", "exp.tmp2025-2", "exp.tmp2025-3"]
    ok = present == want and manager.checkpoints == [first, second, third]
    ckpt.restore(first).assert_consumed()
    all_ranks_agree(group.comm, ok, f"{present} {manager.checkpoints}")


def test_a_name_that_only_looks_like_a_temporary_never_fails_a_save(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    ckpt = mpistrat.Checkpoint(v=make_state(group)[0])
    path = ckpt.save(os.path.join(directory, "model"))
    if group.rank == 0:  # a "process id" too large for the operating system
        Path(directory, f"model.tmp{10**20}-{checkpoint_files._host()}").write_bytes(Path(path).read_bytes())
    group.comm.Barrier()
    ckpt.save(os.path.join(directory, "model"))
    with group.strategy.scope():
        latest = mpistrat.latest_checkpoint(directory)
    all_ranks_agree(group.comm, latest == os.path.join(directory, "model-2"), str(latest))


class Dense:
    """A layer as a port writes one: variables as attributes."""

    def __init__(self, group, fan_in, fan_out, seed):
        rng = np.random.default_rng(seed)
        with group.strategy.scope():
            self.kernel = mpistrat.Variable(rng.standard_normal((fan_in, fan_out)).astype(np.float32))
            self.bias = mpistrat.Variable(np.zeros(fan_out, np.float32))
        self.activation = np.tanh  # not tracked: a function
        self.units = fan_out  # not tracked: a number

    def __call__(self, x):
        return self.activation(x @ self.kernel.numpy() + self.bias.numpy())


class Model:
    def __init__(self, group, seed=0):
        self.hidden = Dense(group, 4, 8, seed)
        self.out = Dense(group, 8, 2, seed + 1)
        self.layers = [self.hidden, self.out]  # a second path to the same layers
        with group.strategy.scope():
            self.optimizer = SGD(0.1, momentum=0.9)

    @property
    def trainable_variables(self):
        return [self.hidden.kernel, self.hidden.bias, self.out.kernel, self.out.bias]


def test_a_model_object_is_tracked_by_its_attributes_and_round_trips(group, tmp_path):
    """tf's Checkpoint tracks a model's attributes: so does mpistrat's (each variable once, named
    by its first attribute path), and a fresh model restores to the same predictions."""
    directory = shared_dir(group, tmp_path)
    model = Model(group)
    grads = [np.ones(v.shape, np.float32) for v in model.trainable_variables]
    group.strategy.run(
        lambda: model.optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    )
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    with group.strategy.scope():
        want = model.out(model.hidden(x))
    path = mpistrat.Checkpoint(model=model).save(os.path.join(directory, "ckpt"))
    fresh = Model(group, seed=7)
    status = mpistrat.Checkpoint(model=fresh).restore(path)
    status.assert_consumed()
    with group.strategy.scope():
        got = fresh.out(fresh.hidden(x))
        slot = fresh.optimizer.get_slot(fresh.out.kernel, "momentum").numpy()
    names = group.comm.bcast(sorted(load_names(path)) if group.rank == 0 else None)
    variables = [f"model/{layer}/{v}" for layer in ("hidden", "out") for v in ("bias", "kernel")]
    slots = [f"model/optimizer/slots/{v}/momentum" for v in variables]
    rate = "model/optimizer/learning_rate"
    checks = RankChecks()
    checks.that(names == sorted([*variables, "model/optimizer/iterations", rate, *slots]))
    checks.that(np.array_equal(got, want) and np.allclose(slot, -0.1 * group.size))
    checks.agree(group.comm, f"{names} {got} {want}")


def test_keys_holding_a_slash_or_a_dot_are_escaped_as_tf_names_them_and_both_round_trip(group, tmp_path):
    """tf names checkpointed objects by their path with '.' written '..' and '/' written '.S', so
    ``{"dense/kernel": k1, "dense": {"kernel": k2}}`` saves two entries (k2 was lost before)."""
    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        k1 = mpistrat.Variable(np.full(3, 1.0, np.float32))
        k2 = mpistrat.Variable(np.full(3, 2.0, np.float32))
        head = mpistrat.Variable(np.full(2, 3.0))
        opt = SGD(0.5, momentum=0.9)
    model = {"dense/kernel": k1, "dense": {"kernel": k2}, "head.b": head}
    group.strategy.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), k1), (np.ones(2), head)]))
    ckpt = mpistrat.Checkpoint(model=model, opt=opt)
    path = ckpt.save(os.path.join(directory, "ckpt"))
    names = group.comm.bcast(sorted(load_names(path)) if group.rank == 0 else None)
    want = ["model/dense.Skernel", "model/dense/kernel", "model/head..b", "opt/iterations"]
    want += ["opt/learning_rate", "opt/slots/model/dense.Skernel/momentum"]
    want += ["opt/slots/model/head..b/momentum"]
    with group.strategy.scope():
        saved = [k1.numpy(), k2.numpy(), head.numpy(), opt.get_slot(k1, "momentum").numpy()]
        for v in (k1, k2, head):
            v.assign(np.zeros(v.shape, v.dtype))
    status = ckpt.restore(path)
    status.assert_consumed()
    with group.strategy.scope():
        got = [k1.numpy(), k2.numpy(), head.numpy(), opt.get_slot(k1, "momentum").numpy()]
    checks = RankChecks()
    checks.that(names == sorted(want) and all(np.array_equal(a, b) for a, b in zip(got, saved, strict=True)))
    checks.that(got[1].tolist() == [2.0, 2.0, 2.0])
    checks.agree(group.comm, f"{names} {got} {saved}")


def test_two_keys_whose_text_is_the_same_are_refused():
    a, b = mpistrat.Variable(np.zeros(2)), mpistrat.Variable(np.ones(2))
    with pytest.raises(InvalidArgumentError, match="two tracked objects are named 'model/1'"):
        mpistrat.Checkpoint(model={1: a, "1": b})


def load_names(path):
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        return list(f.keys())


class KerasLike:
    """Variables only behind a property, as a Keras model exposes them."""

    def __init__(self, variables):
        self._weights = variables

    @property
    def trainable_variables(self):
        return self._weights


def test_objects_without_attributes_use_their_variables_and_others_are_refused():
    w = mpistrat.Variable(np.arange(3.0))
    ckpt = mpistrat.Checkpoint(model=KerasLike([w]))
    assert list(ckpt._entries()) == ["model/trainable_variables/0"]
    with pytest.raises(InvalidArgumentError, match=r"model \(KerasLike\) holds nothing to track"):
        mpistrat.Checkpoint(model=KerasLike([]))  # nothing to track in it
    with pytest.raises(
        InvalidArgumentError, match=r"model \(str\) holds nothing to track; expected a Variable"
    ):
        mpistrat.Checkpoint(model="weights.npz")


def test_a_dataset_that_changed_refuses_the_restore_before_any_variable_is_assigned(group, tmp_path):
    """The datasets' positions are checked with every other entry, before anything is assigned."""
    directory = shared_dir(group, tmp_path)
    data = np.arange(64, dtype=np.float32)
    with group.strategy.scope():
        w = mpistrat.Variable(np.arange(3.0))
    dist = group.strategy.experimental_distribute_dataset(
        mpistrat.ArrayDataset(data, 8, shuffle=True, seed=1)
    )
    it = iter(dist)
    next(it)
    path = mpistrat.Checkpoint(w=w, data=dist).write(os.path.join(directory, "with-data"))
    other = group.strategy.experimental_distribute_dataset(
        mpistrat.ArrayDataset(data, 8, shuffle=True, seed=2)
    )
    with group.strategy.scope():
        w.assign(np.zeros(3))
    ckpt = mpistrat.Checkpoint(w=w, data=other)
    raises_on_every_rank(
        group.comm, InvalidArgumentError, lambda: ckpt.restore(path), "the order of its examples"
    )
    with group.strategy.scope():
        all_ranks_agree(group.comm, not w.numpy().any(), f"assigned before the dataset was refused: {w!r}")
