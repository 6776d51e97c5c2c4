"""Background saves (``CheckpointOptions(enable_async=True)``): the values of the moment of the call,
written while training goes on, finished by the next checkpoint call, ``sync()`` or the end of the
job, and a failure raised on every rank there."""

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mpistrat
import mpistrat.checkpoint.mpiio as mpiio
from mpistrat import CheckpointOptions, InvalidArgumentError
from mpistrat.optimizers import SGD
from mpistrat.values import local_variable
from tests.checkpoint.test_checkpoint import shared_dir
from tests.conftest import WORLD, RankChecks, all_ranks_agree, raises_on_every_rank
from tests.support.launch import MPIEXEC, ROOT, job_environment, launcher_options, run_job

HERE = Path(__file__).resolve().parent

ASYNC = CheckpointOptions(enable_async=True)


def model(group, value=1.0):
    with group.strategy.scope():
        w = mpistrat.Variable(np.full((64, 33), value, np.float32), name="w")
        opt = SGD(0.5, momentum=0.9, shard_state=True)
    group.strategy.run(lambda: opt.apply_gradients([(np.ones((64, 33), np.float32), w)]))
    return w, opt, mpistrat.Checkpoint(w=w, opt=opt)


def test_a_background_save_holds_the_values_of_its_call(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    w, opt, ckpt = model(group)
    with group.strategy.scope():
        saved = [w.numpy(), opt.get_slot(w, "momentum").numpy()]
    path = ckpt.save(os.path.join(directory, "ckpt"), options=ASYNC)
    in_place_at_once = os.path.exists(path)
    for _ in range(2):  # training goes on while the file is written
        group.strategy.run(lambda: opt.apply_gradients([(np.ones((64, 33), np.float32), w)]))
    ckpt.sync()
    checks = RankChecks()
    checks.that(not in_place_at_once and os.path.exists(path) and int(ckpt.save_counter) == 1)
    ckpt.restore(path).assert_consumed()
    with group.strategy.scope():
        now = [w.numpy(), opt.get_slot(w, "momentum").numpy()]
        checks.that(int(opt.iterations.numpy()) == 1 and mpistrat.latest_checkpoint(directory) == path)
    checks.that(all(np.array_equal(a, b) for a, b in zip(saved, now, strict=True)))
    left = sorted(os.listdir(directory))
    checks.that(left == ["checkpoint", "ckpt-1"])
    checks.agree(group.comm, f"{left} {now[0][0, :2]}")


def test_a_background_save_compares_the_copies_of_its_call_not_later_writes(group, tmp_path):
    """The ranks' copies are compared as they were at the call: each rank writing its own value
    into its copy before ``sync()`` (a bug, but after the save) neither refuses the file nor
    changes it."""
    directory = shared_dir(group, tmp_path)
    w, _, ckpt = model(group)
    with group.strategy.scope():
        saved = w.numpy()
    path = ckpt.save(os.path.join(directory, "ckpt"), options=ASYNC)
    local_variable(w).assign(np.full((64, 33), 10.0 + group.rank, np.float32))
    ckpt.sync()
    ckpt.restore(path).assert_consumed()
    with group.strategy.scope():
        ok = np.array_equal(w.numpy(), saved)
    all_ranks_agree(group.comm, ok, f"{w.numpy()[0, :2]}")


def test_sync_on_one_rank_alone_leaves_every_rank_with_its_save_until_every_rank_syncs(group, tmp_path):
    """Rank 0 calls sync() alone while the others reduce: both fail on every rank, and every rank
    still holds its pending save, so the next sync() on every rank puts the file in place."""
    if group.size == 1:
        pytest.skip("needs a rank to call sync alone")
    directory = shared_dir(group, tmp_path)
    _, _, ckpt = model(group)
    path = ckpt.save(os.path.join(directory, "ckpt"), options=ASYNC)
    alone = ckpt.sync if group.rank == 0 else lambda: group.strategy.reduce("SUM", np.ones(3), axis=None)
    raises_on_every_rank(group.comm, mpistrat.CollectiveMismatchError, alone, "different collectives")
    ckpt.sync()
    with group.strategy.scope():
        latest = mpistrat.latest_checkpoint(directory)
        total = group.strategy.reduce("SUM", group.strategy.run(lambda: np.ones(3)), axis=None)
    ok = latest == path and os.path.exists(path) and np.asarray(total).tolist() == [group.size] * 3
    all_ranks_agree(group.comm, ok, f"{latest} {total}")


def test_the_next_checkpoint_call_finishes_a_background_save_first(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    w, _, ckpt = model(group)
    with group.strategy.scope():
        want = w.numpy()
    first = ckpt.save(os.path.join(directory, "ckpt"), options=ASYNC)
    second = ckpt.save(os.path.join(directory, "ckpt"), options=ASYNC)  # waits for the first
    with group.strategy.scope():
        latest = mpistrat.latest_checkpoint(directory)  # waits for the second
        w.assign(np.zeros((64, 33), np.float32))
    checks = RankChecks()
    checks.that(latest == second == os.path.join(directory, "ckpt-2") and os.path.exists(first))
    ckpt.restore(first).assert_consumed()  # and a restore waits too
    with group.strategy.scope():
        checks.that(np.array_equal(w.numpy(), want))
    checks.agree(group.comm, f"{first} {second} {latest}")


def test_consecutive_background_saves_each_hold_their_own_values(group, tmp_path):
    """The staging buffer is reused from one background save to the next (and cut for a smaller
    one): each file still holds the values of its own call, read back with safetensors alone."""
    from safetensors.numpy import load_file

    directory = shared_dir(group, tmp_path)
    w, opt, ckpt = model(group)
    with group.strategy.scope():
        small = mpistrat.Variable(np.arange(7, dtype=np.float32), name="small")
    small_ckpt = mpistrat.Checkpoint(small=small)
    paths, want = [], []
    for step in range(3):
        with group.strategy.scope():
            want.append(w.numpy())
        paths.append(ckpt.save(os.path.join(directory, "ckpt"), options=ASYNC))
        g = np.full((64, 33), step + 1, np.float32)
        group.strategy.run(lambda g=g: opt.apply_gradients([(g, w)]))
    small_path = small_ckpt.save(os.path.join(directory, "small"), options=ASYNC)  # a smaller share
    group.strategy.run(lambda: opt.apply_gradients([(np.ones((64, 33), np.float32), w)]))
    small_ckpt.sync()
    ckpt.sync()
    files = [load_file(p) for p in paths]
    got = [f["w"] for f in files]
    small_got = next(iter(load_file(small_path).values()))
    checks = RankChecks()
    checks.that(all(np.array_equal(g, x) for g, x in zip(got, want, strict=True)))
    checks.that(
        len({g.tobytes() for g in got}) == 3 and np.array_equal(small_got, np.arange(7, dtype=np.float32))
    )
    checks.agree(group.comm, f"{[g[0, :2] for g in got]} {[x[0, :2] for x in want]} {small_got}")


def test_a_manager_records_and_deletes_once_the_file_is_in_place(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    _, _, ckpt = model(group)
    manager = mpistrat.CheckpointManager(ckpt, directory, max_to_keep=1)
    first = manager.save()
    second = manager.save(options=ASYNC)
    before = (
        manager.latest_checkpoint,
        os.path.exists(first),
    )  # still the first: the second is being written
    manager.sync()
    after = (manager.latest_checkpoint, os.path.exists(first), os.path.exists(second))
    ok = before == (first, True) and after == (second, False, True)
    all_ranks_agree(group.comm, ok, f"{before} {after}")


def test_a_failed_background_write_is_raised_on_every_rank_at_the_wait(group, tmp_path, monkeypatch):
    directory = shared_dir(group, tmp_path)
    w, _, ckpt = model(group)
    with group.strategy.scope():
        want = w.numpy()
    good = ckpt.save(os.path.join(directory, "ckpt"))
    real = mpiio.posix_write

    def full(path, header, calls):  # the last rank's disk fills up
        if group.rank == group.size - 1:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real(path, header, calls)

    monkeypatch.setattr(mpiio, "posix_write", full)
    ckpt.save(os.path.join(directory, "ckpt"), options=ASYNC)  # returns: the failure is in the background
    message = raises_on_every_rank(group.comm, OSError, ckpt.sync, "No space left on device")
    assert f"rank {group.size - 1}" in message
    monkeypatch.undo()
    left = sorted(os.listdir(directory))
    with group.strategy.scope():
        w.assign(np.zeros((64, 33), np.float32))
        latest = mpistrat.latest_checkpoint(directory)
    ckpt.restore(latest).assert_consumed()
    with group.strategy.scope():
        ok = latest == good and np.array_equal(w.numpy(), want) and left == ["checkpoint", "ckpt-1"]
    all_ranks_agree(group.comm, ok, f"{latest} {left}")


def test_finalizing_the_strategy_finishes_a_background_save(tmp_path):
    strategy = mpistrat.MPIStrategy(WORLD)
    directory = WORLD.bcast(str(tmp_path), root=0)
    with strategy.scope():
        v = mpistrat.Variable(np.arange(1000.0))
    path = mpistrat.Checkpoint(v=v).write(os.path.join(directory, "c"), options=ASYNC)
    strategy.experimental_finalize()
    all_ranks_agree(WORLD, os.path.exists(path), "not written at finalize")


def test_options_are_checked():
    with pytest.raises(InvalidArgumentError, match="enable_async must be True or False"):
        CheckpointOptions(enable_async="yes")
    with pytest.raises(InvalidArgumentError, match="io_hints must be a dict"):
        CheckpointOptions(io_hints=["striping_factor=4"])
    assert CheckpointOptions(experimental_enable_async_checkpoint=True).enable_async  # tf's older name
    ckpt = mpistrat.Checkpoint(v=mpistrat.Variable(1.0))
    with pytest.raises(InvalidArgumentError, match=r"must be an mpistrat\.CheckpointOptions"):
        ckpt.write("/nonexistent/x", options={"enable_async": True})


EXIT_JOB = """
import sys
import numpy as np
import mpistrat

strategy = mpistrat.MPIStrategy()
with strategy.scope():
    v = mpistrat.Variable(np.arange(50000.0))
ckpt = mpistrat.Checkpoint(v=v)
ckpt.save(sys.argv[1] + "/ckpt", options=mpistrat.CheckpointOptions(enable_async=True))
with strategy.scope():
    v.assign(np.zeros(50000))
print("returned", flush=True)
"""


@pytest.mark.serial
def test_the_end_of_the_job_finishes_a_background_save(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(EXIT_JOB)
    code, out = run_job(script, str(tmp_path), ranks=3, limit=60)
    assert code == 0 and "returned" in out, out
    v = mpistrat.Variable(np.zeros(50000))
    mpistrat.Checkpoint(v=v).restore(mpistrat.latest_checkpoint(tmp_path)).assert_consumed()
    assert np.array_equal(v.numpy(), np.arange(50000.0))
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["checkpoint", "ckpt-1", "job.py"]


def _read_until(proc, text, limit):
    """Lines of ``proc``'s output up to the first holding ``text``; fail (killing it) past ``limit``."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return lines
        if len(lines) > limit:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"no {text!r} in the job's first {len(lines)} lines:\n{''.join(lines)}")


@pytest.mark.serial
@pytest.mark.parametrize("how", ["killed", "interrupted"])
def test_a_background_save_is_in_place_steps_later_without_another_checkpoint_call(tmp_path, how):
    """A job saves ckpt-5 in the background and trains on, calling no checkpoint method again; a few
    steps later the file is in place (it used to wait for the next checkpoint call, so a job killed
    or interrupted then resumed from the save before), and a job killed (SIGKILL) or interrupted
    (Ctrl-C: SIGINT through mpiexec) three steps after that resumes from step 5."""
    cmd = [str(MPIEXEC), *launcher_options(), "-n", "3", sys.executable, str(HERE / "async_job.py")]
    with subprocess.Popen(
        [*cmd, str(tmp_path), "train"],
        cwd=ROOT,
        env=job_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            said = _read_until(proc, "ckpt-5 in place", limit=300)[-1]
            # the log of the save: its own writing time, not the wait for the next checkpoint call
            assert re.search(
                r"INFO: Checkpoint.save: .*ckpt-5 in place \([\d.]+ MiB written in the background", said
            )
            now = _read_until(proc, "rank 0 step", limit=50)[-1]
            _read_until(proc, f"rank 0 step {int(now.split()[3]) + 3} ", limit=50)
            if how == "killed":
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.send_signal(signal.SIGINT)  # mpiexec passes it to every rank
            proc.communicate(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    code, out = run_job(HERE / "async_job.py", str(tmp_path), "resume", ranks=3, limit=60)
    assert code == 0, out
    assert all(f"rank {r} restored ckpt-5: step 5, w [5.0]" in out for r in range(3)), out


def test_the_log_gives_the_writes_own_time_and_steps_send_nothing_more_once_it_is_in_place(
    group, tmp_path, monkeypatch, mpistrat_log
):
    """Counted per step (a CountingComm under the strategy): a step sends what it sends without a save;
    while a save is being written, one handshake more (whether every rank's share is written); once it
    is in place, nothing more again. The log's time is the writers' own (each held 0.3 s here), not the
    1.5 s the job waited before its next step, which put the file in place."""
    import time

    from tests.support.counting import CountingComm, Ledger

    strategy = mpistrat.MPIStrategy(CountingComm(group.comm))
    directory = shared_dir(group, tmp_path)
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(1000, np.float32), name="w")
    ckpt = mpistrat.Checkpoint(w=w)

    def step():
        with Ledger.recording() as ledger:
            strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.float32(1)))
        return [(c.name, c.sent) for c in ledger.log]

    step()  # the first, checked in full
    alone = step()
    real = mpiio.posix_write

    def slow(path, header, calls):
        time.sleep(0.3)
        real(path, header, calls)

    monkeypatch.setattr(mpiio, "posix_write", slow)
    path = ckpt.save(os.path.join(directory, "ckpt"), options=ASYNC)
    writing = step()  # the writers sleep: not written yet on any rank
    time.sleep(1.5)
    committing = step()
    in_place = os.path.exists(path)
    after = [step() for _ in range(2)]
    strategy.experimental_finalize()
    poll = ("Allreduce", 104)  # one handshake: 13 int64
    checks = RankChecks()
    checks.that(writing == [*alone, poll] and committing[: len(alone) + 1] == [*alone, poll] and in_place)
    checks.that(after == [alone, alone])
    said = [m for level, m in mpistrat_log if "in place" in m]
    seconds = [float(x) for m in said for x in re.findall(r"in the background in ([\d.]+) s", m)]
    if WORLD.Get_rank() == 0:  # the logger passes world rank 0's INFO (rank 0 of its group, too)
        checks.that(len(seconds) == 1 and 0.3 <= seconds[0] < 1.2)
    checks.agree(group.comm, f"{alone} | {writing} | {committing[:6]} | {after} | {said}")
