"""PreemptionCheckpointHandler: one stop agreed by every rank, one checkpoint, an exact resume.

The in-process tests run serially and under mpiexec; the jobs at the end (serial pass only)
start ``mpiexec -n 3`` with hard limits, as tests/diagnostics/test_faults.py does, and send real signals.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

import mpistrat
from mpistrat import InvalidArgumentError
from mpistrat.checkpoint.preemption import RESTART_EXIT_CODE, RUN_CALLS
from tests.checkpoint.test_checkpoint import shared_dir
from tests.conftest import all_ranks_agree, raises_on_every_rank
from tests.support.counting import CountingComm, Ledger


class Stopped(Exception):
    """Raised by the tests' exit_fn: the handler saved and would have exited."""


def stop() -> None:
    raise Stopped


@pytest.fixture(autouse=True)
def no_stale_handlers(request):
    """Each test's handlers are gone after it, and no stop flag outlives it."""
    yield
    gc.collect()
    for name in ("group", "world"):
        if name in request.fixturenames:
            collectives = request.getfixturevalue(name).strategy.extended.collectives
            collectives.stop.clear()


def model(group, value=0.0):
    with group.strategy.scope():
        w = mpistrat.Variable(np.float32(value), name="w")
    return w, mpistrat.Checkpoint(w=w)


def step(group, w):
    """One training step: an all_reduce in replica context, then an update in cross-replica context."""
    total = group.strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.float32(1)))
    with group.strategy.scope():
        w.assign_add(np.float32(total) / np.float32(group.size))


def run_until_stopped(handler, fn, limit):
    """Call handler.run(fn) until exit_fn raises Stopped; the run calls completed then (None: never)."""
    for _ in range(limit):
        try:
            handler.run(fn)
        except Stopped:
            return handler.total_run_calls
    return None


def files(group, directory):
    return group.comm.bcast(sorted(os.listdir(directory)) if group.rank == 0 else None, root=0)


def test_a_flag_on_one_rank_reaches_every_rank_at_the_next_collective(group):
    collectives = group.strategy.extended.collectives
    if group.rank == group.size - 1:
        collectives.stop.request()
    before = collectives.stop.agreed
    w, _ = model(group)
    step(group, w)
    all_ranks_agree(group.comm, not before and collectives.stop.agreed, f"{before} {collectives.stop.agreed}")


def test_while_nothing_is_pending_a_step_sends_what_it_sends_without_the_handler(group, tmp_path):
    strategy = mpistrat.MPIStrategy(CountingComm(group.comm))
    with strategy.scope():
        w = mpistrat.Variable(np.float32(0), name="w")
    handler = mpistrat.PreemptionCheckpointHandler(mpistrat.Checkpoint(w=w), shared_dir(group, tmp_path))

    def one_step():
        return strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(8, np.float32)))

    handler.run(one_step)  # the first call may differ (nothing to compare with yet)
    with Ledger.recording() as plain:
        one_step()
    with Ledger.recording() as handled:
        handler.run(one_step)
        handler.run(one_step)
    ok = handled.names() == plain.names() * 2 and handled.moved == 2 * plain.moved
    all_ranks_agree(group.comm, ok, f"plain {plain.log}; with the handler {handled.log}")


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_call_and_saves_once(group, tmp_path):
    directory = shared_dir(group, tmp_path)
    w, ckpt = model(group)
    handler = mpistrat.PreemptionCheckpointHandler(ckpt, directory, mpistrat.TerminationConfig(exit_fn=stop))

    def signalled_step():
        if group.rank == group.size - 1 and handler.total_run_calls == 2:  # in the 3rd call
            os.kill(os.getpid(), signal.SIGUSR1)
        step(group, w)

    stopped = run_until_stopped(handler, signalled_step, 10)
    saved = files(group, directory)
    # A fresh start restores the weights and the count: 3 steps of +1.
    w2, ckpt2 = model(group, value=-5.0)
    again = mpistrat.PreemptionCheckpointHandler(ckpt2, directory)
    with group.strategy.scope():
        restored = float(w2.numpy())
    ok = stopped == 3 and saved == ["checkpoint", "ckpt-1"] and again.total_run_calls == 3 and restored == 3.0
    all_ranks_agree(group.comm, ok, f"stopped after {stopped}, files {saved}, restored {restored}")


def test_save_fn_and_a_watcher_on_one_rank(group):
    w, ckpt = model(group)
    saves = []
    watcher_rank = group.size - 1
    config = mpistrat.TerminationConfig(
        termination_watcher_fn=lambda: group.rank == watcher_rank,
        save_fn=lambda: saves.append(float(w.numpy())),
        exit_fn=stop,
    )
    handler = mpistrat.PreemptionCheckpointHandler(
        mpistrat.CheckpointManager(ckpt, "unused", 1), None, config
    )

    def slow_step():
        step(group, w)
        time.sleep(0.05)

    stopped = run_until_stopped(handler, slow_step, 200)  # the watcher is polled once a second
    counts = group.comm.allgather(stopped)
    ok = stopped is not None and len(set(counts)) == 1 and saves == [float(stopped)]
    all_ranks_agree(group.comm, ok, f"stopped after {counts}; save_fn saw {saves}")


@pytest.mark.parametrize("grace, want", [(1000.0, 1), (10.0, None)])
def test_the_allocations_end_minus_grace_period(group, monkeypatch, grace, want):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 100))  # as Slurm 23.02+ sets it
    w, ckpt = model(group)
    config = mpistrat.TerminationConfig(grace_period=grace, save_fn=lambda: None, exit_fn=stop)
    handler = mpistrat.PreemptionCheckpointHandler(
        mpistrat.CheckpointManager(ckpt, "unused", 1), None, config
    )
    stopped = run_until_stopped(handler, lambda: step(group, w), 4)
    all_ranks_agree(group.comm, stopped == want, f"stopped after {stopped}, expected {want}")


def test_with_the_check_off_the_handler_agrees_by_itself(group, tmp_path):
    strategy = mpistrat.MPIStrategy(
        group.comm.Dup(), communication_options=mpistrat.CommunicationOptions(check=False)
    )
    with strategy.scope():
        w = mpistrat.Variable(np.float32(0), name="w")
    handler = mpistrat.PreemptionCheckpointHandler(
        mpistrat.Checkpoint(w=w),
        shared_dir(group, tmp_path),
        mpistrat.TerminationConfig(exit_fn=stop),
    )

    def signalled_step():
        if group.rank == 0 and handler.total_run_calls == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.float32(1)))

    stopped = run_until_stopped(handler, signalled_step, 6)
    counts = group.comm.allgather(stopped)
    all_ranks_agree(group.comm, counts == [2] * group.size, f"stopped after {counts}")


def test_bad_arguments(world, tmp_path):
    w, ckpt = model(world)
    raises_on_every_rank(
        world.comm, InvalidArgumentError, lambda: mpistrat.PreemptionCheckpointHandler(ckpt), "checkpoint_dir"
    )
    raises_on_every_rank(
        world.comm,
        InvalidArgumentError,
        lambda: mpistrat.PreemptionCheckpointHandler({"w": w}, str(tmp_path)),
        "got dict",
    )
    raises_on_every_rank(
        world.comm,
        InvalidArgumentError,
        lambda: mpistrat.PreemptionCheckpointHandler(ckpt, str(tmp_path), {"grace_period": 1}),
        "TerminationConfig",
    )
    bad = mpistrat.TerminationConfig(grace_period=-1)
    raises_on_every_rank(
        world.comm,
        InvalidArgumentError,
        lambda: mpistrat.PreemptionCheckpointHandler(ckpt, shared_dir(world, tmp_path), bad),
        "grace_period",
    )


# -- whole jobs under mpiexec -n 3, with real signals -------------------------------------------

STEPS, AT = 12, 5


def train(tmp_path, name, *signal_args, limit=60):
    from tests.diagnostics.test_faults import run_job

    env = {"SLURM_JOB_ID": ""}  # these jobs exit with the restart code, as outside Slurm
    code, out = run_job(
        "preempted_training.py", str(tmp_path / name), str(tmp_path / f"{name}.npy"), str(STEPS),
        *signal_args, limit=limit, env=env,
    )  # fmt: skip
    return code, out


def stopped_after(out):
    """Each rank's ``rank <r> stopped after run call <n>`` (lines of different ranks may interleave)."""
    return {int(r): int(n) for r, n in re.findall(r"rank (\d+) stopped after run call (\d+)", out)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    code, out = train(tmp_path, "plain")
    assert code == 0, out
    return np.load(tmp_path / "plain.npy")


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize(
    "signal_args",
    [("USR1", "1", str(AT)), ("TERM", "all", str(AT)), ("USR1", "2", str(AT), "during-save")],
    ids=["usr1-one-rank", "term-every-rank", "signal-during-the-save"],
)
def test_a_preempted_job_saves_once_exits_and_resumes_to_the_uninterrupted_weights(
    tmp_path, uninterrupted, signal_args
):
    code, out = train(tmp_path, "job", *signal_args)
    assert code == RESTART_EXIT_CODE, out
    stops = stopped_after(out)
    assert sorted(stops) == [0, 1, 2] and len(set(stops.values())) == 1, out  # every rank, the same call
    stopped = stops[0]
    assert AT <= stopped <= AT + 1, out  # the signal came during call AT: within one step
    assert sorted(os.listdir(tmp_path / "job")) == ["checkpoint", "ckpt-1"], out  # one file, no temporaries
    for sign in ("Traceback", "MPI_Abort", "cannot complete"):  # the watchdog saw clean departures
        assert sign not in out, out
    assert "saving a checkpoint" in out and f"exiting with status {RESTART_EXIT_CODE}" in out, out

    code, out = train(tmp_path, "job")
    assert code == 0, out
    assert f"restored {tmp_path / 'job' / 'ckpt-1'}; continuing after run call {stopped}" in out, out
    resumed = np.load(tmp_path / "job.npy")
    assert resumed.dtype == np.float32 and np.array_equal(resumed, uninterrupted), (resumed, uninterrupted)


def test_the_run_counter_is_an_entry_of_the_checkpoint(world, tmp_path):
    directory = shared_dir(world, tmp_path)
    w, ckpt = model(world)
    handler = mpistrat.PreemptionCheckpointHandler(ckpt, directory, mpistrat.TerminationConfig(exit_fn=stop))
    for _ in range(4):
        handler.run(step, world, w)
    handler._collectives.stop.request()
    step(world, w)  # carries the flag
    with pytest.raises(Stopped):
        handler.save_checkpoint_if_preempted()
    data = world.comm.bcast(load_file(os.path.join(directory, "ckpt-1")) if world.rank == 0 else None)
    all_ranks_agree(world.comm, int(data[RUN_CALLS]) == 4 and float(data["w"]) == 5.0, str(data))


def test_normal_events_are_info_and_a_checkpoint_without_a_run_count_says_so(world, tmp_path, mpistrat_log):
    """Watching and restoring are INFO; a checkpoint a manager saved outside any handler (mid-pass,
    by the program's own loop) holds no run count: the handler says so instead of "run call 0"."""
    directory = shared_dir(world, tmp_path)
    w, ckpt = model(world, 3.0)
    mpistrat.CheckpointManager(ckpt, directory, max_to_keep=1).save()
    handler = mpistrat.PreemptionCheckpointHandler(ckpt, directory, mpistrat.TerminationConfig(exit_fn=stop))
    assert handler.total_run_calls == 0
    for _ in range(2):
        handler.run(step, world, w)
    handler._collectives.stop.request()
    step(world, w)
    with pytest.raises(Stopped):
        handler.save_checkpoint_if_preempted()
    again = mpistrat.PreemptionCheckpointHandler(ckpt, directory, mpistrat.TerminationConfig(exit_fn=stop))
    if world.rank == 0:  # the rank whose records the logger lets through
        said = [(level, m) for level, m in mpistrat_log if "PreemptionCheckpointHandler" in m]
        assert (
            "INFO",
            f"PreemptionCheckpointHandler: restored {directory}/ckpt-1, saved without a run "
            "count (not by this handler): run calls count from 0",
        ) in said, said
        assert (
            "INFO",
            f"PreemptionCheckpointHandler: restored {directory}/ckpt-2; continuing after run call 2",
        ) in said, said
        assert {level for level, m in said if "watching" in m} == {"INFO"}
        stopping = [level for level, m in said if "stops after" in m or "Handler: saved " in m]
        assert stopping == ["WARNING", "WARNING"], said
    assert again.total_run_calls == 2


@pytest.mark.parametrize("at_window_end", [False, True])
def test_a_stop_mid_window_waits_for_the_windows_end_when_the_manager_says_so(group, tmp_path, at_window_end):
    """A stop agreed after the first of 3 accumulating calls: by default the handler saves at once
    (the file holds the window's gradients); with save_at_window_end it runs the window's last two
    calls first, so the file holds the update and no accumulation entries (it restores at any count)."""
    from mpistrat.checkpoint.files import read_table
    from mpistrat.optimizers import SGD

    directory = shared_dir(group, tmp_path)
    with group.strategy.scope():
        w = mpistrat.Variable(np.zeros(4, np.float32), name="w")
        opt = SGD(0.5, gradient_accumulation_steps=3)
    manager = mpistrat.CheckpointManager(
        mpistrat.Checkpoint(w=w, opt=opt), directory, max_to_keep=1, save_at_window_end=at_window_end
    )
    handler = mpistrat.PreemptionCheckpointHandler(
        manager, termination_config=mpistrat.TerminationConfig(exit_fn=stop)
    )

    def accumulate():
        if group.rank == group.size - 1 and handler.total_run_calls == 0:  # in the first call
            handler._request("a test's stop")
        group.strategy.run(lambda: opt.apply_gradients([(np.ones(4, np.float32), w)]))

    stopped = run_until_stopped(handler, accumulate, 10)
    names = sorted(read_table(manager.latest_checkpoint).entries)
    accumulated = [n for n in names if "/accumulation/" in n]
    with group.strategy.scope():
        now = w.numpy().tolist()
    # 3 calls of gradient 1 on every rank: one update by -0.5 times their mean, summed over the ranks
    want = (
        (3, [], [-0.5 * group.size] * 4)
        if at_window_end
        else (1, ["opt/accumulation/count", "opt/accumulation/w"], [0.0] * 4)
    )
    all_ranks_agree(group.comm, (stopped, accumulated, now) == want, f"{stopped} {names} {now}")
