"""Numbered saves, CheckpointManager and latest_checkpoint against what tf.train does (TensorFlow 2.21)."""

import os

import numpy as np
import pytest

import mpistrat
from mpistrat import ContextError, InvalidArgumentError
from tests.checkpoint.test_checkpoint import removals_held, shared_dir
from tests.conftest import RankChecks


def files(group, directory):
    """The directory's files as rank 0 sees them (it writes and deletes them), on every rank."""
    return group.comm.bcast(sorted(os.listdir(directory)) if group.rank == 0 else None, root=0)


def state(group, value=0.0):
    with group.strategy.scope():
        v = mpistrat.Variable(value, name="v")
        seen = mpistrat.Variable(0.0, synchronization="ON_READ", aggregation="SUM", name="seen")
    return v, seen, mpistrat.Checkpoint(v=v, seen=seen)


def names(paths):
    return [os.path.basename(p) for p in paths]


def test_save_numbers_its_files_and_write_does_not(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    ckpt = state(group, 1.0)[2]
    prefix = os.path.join(directory, "ck")
    # tf: save("d1/ck") twice gives d1/ck-1, d1/ck-2 and save_counter 2; latest_checkpoint("d1") is d1/ck-2.
    saved = [ckpt.save(prefix), ckpt.save(prefix)]
    plain = ckpt.write(os.path.join(directory, "plain"))  # tf: write leaves the counter and the index alone
    with group.strategy.scope():
        latest = mpistrat.latest_checkpoint(directory)
    checks = RankChecks()
    checks.that(
        saved == [prefix + "-1", prefix + "-2"] and int(ckpt.save_counter) == 2 and latest == saved[1]
    )
    checks.that(plain == os.path.join(directory, "plain"))
    # tf: a new Checkpoint restoring ck-2 gets save_counter 2, and its next save is ck-3.
    _, _, again = state(group)
    again.restore(latest).assert_consumed()
    counter = int(again.save_counter)
    checks.that(counter == 2 and again.save(prefix) == prefix + "-3")
    again.read(plain).assert_consumed()  # tf: read() of a write()'s file restores its save_counter (2)
    checks.that(
        int(again.save_counter) == 2
        and files(group, directory) == ["checkpoint", "ck-1", "ck-2", "ck-3", "plain"]
    )
    checks.agree(group.comm, f"{saved} {plain} {latest} {counter} {files(group, directory)}")


def test_manager_keeps_the_newest_and_deletes_the_oldest_first(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    v, seen, ckpt = state(group)
    manager = mpistrat.CheckpointManager(ckpt, directory, max_to_keep=2)
    empty = (manager.latest_checkpoint, manager.checkpoints)  # tf: None, []
    saved = []
    for k in range(3):
        with group.strategy.scope():
            v.assign(float(k + 1))
        group.strategy.run(lambda: seen.assign_add(1.0))
        saved.append(manager.save())
    # tf: d2/ckpt-1, d2/ckpt-2, d2/ckpt-3; checkpoints ['d2/ckpt-2', 'd2/ckpt-3']; only those files.
    checks = RankChecks()
    checks.that(empty == (None, []) and names(saved) == ["ckpt-1", "ckpt-2", "ckpt-3"])
    checks.that(manager.checkpoints == saved[1:] and manager.latest_checkpoint == saved[2])
    checks.that(files(group, directory) == ["checkpoint", "ckpt-2", "ckpt-3"])
    # tf: save(checkpoint_number=10) gives ckpt-10, checkpoints ['ckpt-3', 'ckpt-10'], save_counter 4.
    numbered = manager.save(checkpoint_number=10)
    checks.that(names([numbered]) == ["ckpt-10"] and names(manager.checkpoints) == ["ckpt-3", "ckpt-10"])
    checks.that(
        int(ckpt.save_counter) == 4 and files(group, directory) == ["checkpoint", "ckpt-10", "ckpt-3"]
    )
    with group.strategy.scope():
        v.assign(0.0)
    ckpt.restore(saved[2]).assert_consumed()
    with group.strategy.scope():
        restored = (float(v.numpy()), float(seen.numpy()))
    checks.that(restored == (3.0, 3.0 * group.size))
    checks.agree(group.comm, f"{empty} {saved} {numbered} {manager.checkpoints} {restored}")


def test_a_large_deleted_checkpoint_is_freed_after_the_save_returns(group, tmp_path, monkeypatch):
    """The oldest file beyond max_to_keep leaves the directory's listing and index at once; its last
    name (a temporary's) goes in a thread, which the save does not wait for (held until it returned)."""
    directory = shared_dir(group, tmp_path)
    *_, ckpt = state(group)
    manager = mpistrat.CheckpointManager(ckpt, directory, max_to_keep=1)
    first = manager.save()
    with removals_held(monkeypatch):
        second = manager.save()
        during = files(group, directory)
    checks = RankChecks()
    checks.that(names([first, second]) == ["ckpt-1", "ckpt-2"] and manager.checkpoints == [second])
    settled = [n for n in during if ".replaced.tmp" not in n]  # the index's old file is set aside too
    checks.that(
        settled == ["checkpoint", "ckpt-2"] and any(n.startswith("ckpt-1.replaced.tmp") for n in during)
    )
    checks.that(files(group, directory) == ["checkpoint", "ckpt-2"])
    with group.strategy.scope():
        checks.that(mpistrat.latest_checkpoint(directory) == second)
    checks.agree(group.comm, f"{during} {files(group, directory)} {manager.checkpoints}")


def test_a_restarted_job_finds_the_checkpoints_and_continues_after_restoring(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    first = mpistrat.CheckpointManager(state(group)[2], directory, max_to_keep=2)
    for _ in range(3):
        first.save()
    first.save(checkpoint_number=10)
    # tf: a new manager sees latest ckpt-10 and checkpoints [ckpt-3, ckpt-10], save_counter 0 until a restore;
    # saving without restoring writes ckpt-1, keeping [ckpt-10, ckpt-1].
    _, _, fresh = state(group)
    second = mpistrat.CheckpointManager(fresh, directory, max_to_keep=2)
    found = (names([second.latest_checkpoint]), names(second.checkpoints), int(fresh.save_counter))
    unrestored = second.save()
    checks = RankChecks()
    checks.that(found == (["ckpt-10"], ["ckpt-3", "ckpt-10"], 0) and names([unrestored]) == ["ckpt-1"])
    checks.that(names(second.checkpoints) == ["ckpt-10", "ckpt-1"])
    # tf: restore(latest) first, and the numbering continues: save_counter 1 from ckpt-1, next ckpt-2.
    v, _, third_ckpt = state(group, -5.0)
    third = mpistrat.CheckpointManager(third_ckpt, directory, max_to_keep=3)
    third_ckpt.restore(third.latest_checkpoint).assert_consumed()
    counter = int(third_ckpt.save_counter)
    continued = third.save()
    checks.that(counter == 1 and names([continued]) == ["ckpt-2"] and float(v.numpy()) == 0.0)
    checks.that(names(third.checkpoints) == ["ckpt-10", "ckpt-1", "ckpt-2"])
    checks.that(files(group, directory) == ["checkpoint", "ckpt-1", "ckpt-10", "ckpt-2"])
    checks.agree(group.comm, f"{found} {unrestored} {counter} {continued} {third.checkpoints}")


def test_checkpoint_name_resaving_a_number_and_keeping_all(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    ckpt = state(group)[2]
    model = mpistrat.CheckpointManager(
        ckpt, os.path.join(directory, "d3"), max_to_keep=2, checkpoint_name="model"
    )
    # tf: save() then save(checkpoint_number=1) both give d3/model-1, and checkpoints is ['d3/model-1'].
    first, again = model.save(), model.save(checkpoint_number=1)
    checks = RankChecks()
    checks.that(first == again == os.path.join(directory, "d3", "model-1") and model.checkpoints == [first])
    keep_all = mpistrat.CheckpointManager(ckpt, os.path.join(directory, "d5"), max_to_keep=None)
    for _ in range(3):
        keep_all.save()
    # tf: max_to_keep=None keeps every checkpoint (numbered on by the shared save_counter: 3, 4, 5 here).
    checks.that(names(keep_all.checkpoints) == ["ckpt-3", "ckpt-4", "ckpt-5"])
    checks.that(keep_all.directory == os.path.join(directory, "d5") and keep_all.checkpoint is ckpt)
    checks.agree(group.comm, f"{first} {again} {model.checkpoints} {keep_all.checkpoints}")


def test_bad_arguments_and_contexts(world, tmp_path):
    ckpt = state(world)[2]
    # tf: ValueError("Expected a positive integer or `None` for `max_to_keep`, got 0.")
    for bad in (0, -1, True, 2.0):
        with pytest.raises(
            InvalidArgumentError, match="Expected a positive integer or `None` for `max_to_keep`"
        ):
            mpistrat.CheckpointManager(ckpt, str(tmp_path), max_to_keep=bad)
    with pytest.raises(InvalidArgumentError, match=r"must be an mpistrat\.Checkpoint"):
        mpistrat.CheckpointManager({"v": 1}, str(tmp_path), max_to_keep=1)
    manager = mpistrat.CheckpointManager(ckpt, shared_dir(world, tmp_path), max_to_keep=1)
    with pytest.raises(InvalidArgumentError, match="checkpoint_number must be an integer"):
        manager.save(checkpoint_number=1.5)
    with pytest.raises(ContextError, match="cross-replica"):
        world.strategy.run(manager.save)
    assert manager.checkpoints == [] and int(ckpt.save_counter) == 0
    step = mpistrat.Variable(np.int64(7))
    assert os.path.basename(manager.save(checkpoint_number=step)) == "ckpt-7"
