"""Fault injection: real ``mpiexec -n 3`` jobs that fail on purpose (serial pass only).

Each job has a hard wall-clock limit (the bound the guarantee promises, start-up included);
a job that outlives it is killed, with all its processes, and the test fails.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from mpistrat.collectives import step_check
from mpistrat.diagnostics import side_channel
from tests.support import launch
from tests.support.launch import MPIEXEC

FAULTS = Path(__file__).resolve().parents[1] / "faults"
RANKS = 3

pytestmark = [
    pytest.mark.serial,
    pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec next to {sys.executable}"),
    pytest.mark.slow,
]


def run_job(
    script: str, *args: str, limit: float, env: dict[str, str] | None = None, ranks: int = RANKS
) -> tuple[int, str]:
    """Run ``tests/faults/<script>`` under ``mpiexec -n ranks``; return (exit code, stdout + stderr)."""
    return launch.run_job(FAULTS / script, *args, ranks=ranks, limit=limit, env=env)


def site(script: str, text: str) -> str:
    """Where ``tests/faults/<script>``'s first line starting with ``text`` is, as diagnoses name call
    sites (``tests/faults/<script>:<line>``): the jobs' line numbers stay out of the tests."""
    lines = (FAULTS / script).read_text().splitlines()
    return f"tests/faults/{script}:{next(i for i, line in enumerate(lines, 1) if line.startswith(text))}"


def on_every_rank(out: str, text: str) -> bool:
    """Whether each rank printed ``rank <r> <text>`` (lines of different ranks may interleave)."""
    return all(f"rank {r} {text}" in out for r in range(RANKS))


@pytest.mark.parametrize("check", ["1", "step"])
def test_exception_in_run_ends_the_job_with_that_ranks_traceback(check):
    code, out = run_job("raise_in_run.py", limit=10, env={"MPISTRAT_CHECK": check})
    assert code != 0, out
    assert "[rank 1] Traceback (most recent call last):" in out, out
    assert "[rank 1] RuntimeError: boom on rank 1" in out, out
    assert "calling MPI_Abort" in out, out


@pytest.mark.parametrize("step_kind", ["sharded", "groups"])
def test_an_update_that_raises_on_one_rank_inside_a_step_ends_the_job_at_once(step_kind):
    # The others wait in the step's all-gather (sharded) or the next group's all-reduce: the error
    # cannot be shared in strategy.run's closing handshake, so the exception hook ends the job.
    code, out = run_job("update_raises.py", step_kind, limit=15)
    assert code != 0, out
    assert "[rank 1] FloatingPointError: the update failed on rank 1" in out, out
    assert "[rank 1] mpistrat: calling MPI_Abort to end the job" in out, out


def test_a_rank_that_leaves_by_an_update_error_inside_a_step_is_named_by_the_others():
    # With the hook off rank 1 exits; it counts as having left after the collective before the step,
    # so the others, in the step's transfer, end at once naming it.
    code, out = run_job("update_raises.py", "stream", limit=15, env={"MPISTRAT_ABORT_ON_EXCEPTION": "0"})
    assert code != 0, out
    assert "cannot complete: rank 1 exited after collective #6 (an uncaught FloatingPointError)" in out, out


@pytest.mark.parametrize("how", ["raise", "caught"])
def test_a_backward_pass_that_raises_on_one_rank_with_the_progress_thread_running(how):
    # Rank 1's generator raises with sums in flight and mpistrat's progress thread running: as without
    # the thread, the error reaches every rank in the step's handshake. Uncaught, the job ends with
    # rank 1's traceback; caught, every rank goes on, trains alike and exits with no thread left.
    code, out = run_job("stream_raises.py", how, limit=15)
    assert (
        f"rank 1 raises with the progress thread running: {MPI.Query_thread() >= MPI.THREAD_MULTIPLE}" in out
    )
    if how == "raise":
        assert code != 0, out
        assert "[rank 1] FloatingPointError: the backward pass failed on rank 1" in out, out
        assert "calling MPI_Abort" in out, out
        assert "finished" not in out, out
    else:
        assert code == 0, out
        assert on_every_rank(
            out, "caught apply_gradients (collective #9) failed on rank 1: the backward pass"
        ), out
        # the building step and steps 2 and 3: three sums of RANKS ones, times -0.5
        assert on_every_rank(out, f"finished, weights {-0.5 * 3 * RANKS}, a progress thread left: False"), out


def test_an_update_error_caught_inside_a_step_ends_the_job_by_the_timeout():
    code, out = run_job("update_raises.py", "sharded", "caught", limit=20, env={"MPISTRAT_TIMEOUT": "3"})
    assert code != 0, out
    assert "rank 1 caught the update failed on rank 1" in out, out
    assert "did not complete within its timeout of 3 s" in out, out
    # whichever rank's deadline comes first speaks: rank 1 in the next step, or the others in this one
    assert (
        "rank 1 is in apply_gradients (collective #8)" in out
        or "rank 0 is in apply_gradients (collective #7)" in out
    ), out
    assert "finished" not in out, out


def test_an_mpi_error_in_a_transfer_is_an_mpistrat_error_and_ends_the_job_even_if_caught():
    code, out = run_job("mpi_error.py", "transfer", limit=20)
    assert code != 0, out
    called = site("mpi_error.py", "    return mpistrat.get_replica_context().all_reduce")
    assert (
        f"rank 1 caught CommunicationError: all_reduce (collective #3, called at {called} in step) failed "
        "in MPI on rank 1: "
    ) in out, out
    assert "The ranks' flight records agree: MPI's error is not one of differing arguments" in out, out
    assert "[rank 1] mpistrat: calling MPI_Abort to end the job" in out, out
    assert "finished" not in out, out


def test_a_shape_that_differs_in_an_unchecked_collective_names_the_collective_whatever_mpi_makes_of_it():
    code, out = run_job("mpi_error.py", "shapes", limit=20, env={"MPISTRAT_CHECK": "step"})
    assert code != 0, out
    called = site("mpi_error.py", "    return mpistrat.get_replica_context().all_reduce")
    family = MPI.Get_library_version()
    if family.startswith("MPICH"):  # it aborts inside the Allreduce, whatever the error handler
        assert "Message truncated" in out, out
        return
    fingerprints = r"ranks 0, 2: all_reduce \[fp [0-9a-f]{8}\]; rank 1: all_reduce \[fp [0-9a-f]{8}\]"
    if family.startswith("Open MPI"):  # it returns MPI_ERR_TRUNCATE on the ranks that received too much
        assert f"all_reduce (collective #11, called at {called} in step) failed in MPI" in out, out
        assert "MPI_ERR_TRUNCATE" in out, out
        assert re.search("The ranks differed first at collective #11: " + fingerprints, out), out
    else:  # Intel MPI completes it: the step's closing handshake finds the difference
        assert re.search("collective #11 ran unchecked .*" + fingerprints, out), out


def test_an_unchecked_collective_that_differed_is_named_when_the_program_ends():
    code, out = run_job("unchecked_at_exit.py", limit=15, env={"MPISTRAT_CHECK": "step"})
    assert code != 0, out
    assert on_every_rank(out, "reached the end"), out
    assert "at exit: collective #3 ran unchecked (MPISTRAT_CHECK=step)" in out, out
    assert "ranks 0, 2: reduce [fp" in out and "rank 1: reduce [fp" in out, out


def test_exception_in_a_thread_ends_the_job():
    code, out = run_job("thread_raises.py", limit=10)
    assert code != 0, out
    assert "[rank 1] Exception in thread loader:" in out, out
    assert "[rank 1] OSError: loader thread failed on rank 1" in out, out


def test_abort_on_exception_can_be_turned_off():
    # Without the hook rank 1's traceback is Python's own. Its exception in strategy.run reaches the
    # others in run's closing handshake (they were in an all_reduce): they raise it too and end.
    code, out = run_job("raise_in_run.py", limit=15, env={"MPISTRAT_ABORT_ON_EXCEPTION": "0"})
    assert code != 0, out
    assert "[rank 1] Traceback" not in out and "RuntimeError: boom on rank 1" in out, out
    assert (
        "RuntimeError: strategy.run (result) (collective #1) failed on rank 1, which left all_reduce "
        "(collective #1, called at tests/faults/raise_in_run.py:13 in step) where ranks 0, 2 waited: "
        "boom on rank 1"
    ) in out, out


def test_mismatched_arguments_raise_on_every_rank_with_the_key_path():
    code, out = run_job("mismatch_args.py", limit=30)
    assert code == 0, out
    for case in ("shape", "structure", "dtype", "reduce op", "all_gather dims"):
        assert on_every_rank(out, f"case {case}: ok"), out
    assert on_every_rank(out, "after: ok"), out


def test_collectives_in_different_orders_raise_instead_of_mixing_data():
    code, out = run_job("wrong_order.py", limit=30)
    assert code == 0, out
    message = (
        "ranks are in different collectives: rank 0: all_gather (collective #1) at "
        "tests/faults/wrong_order.py:14 in step; ranks 1, 2: all_reduce (collective #1) at "
        "tests/faults/wrong_order.py:15 in step."
    )
    assert on_every_rank(out, f"mismatch: {message}"), out
    assert on_every_rank(out, "after: ok"), out


@pytest.mark.parametrize("how", ["option", "env", "check off"])
def test_a_skipped_collective_times_out_naming_the_missing_rank(how):
    env = {"option": {}, "env": {"MPISTRAT_TIMEOUT": "5"}, "check off": {"MPISTRAT_CHECK": "0"}}[how]
    code, out = run_job("skip_collective.py", *(["--env"] if how == "env" else []), limit=15, env=env)
    assert code != 0, out
    # with the check on each strategy.run closes with a collective of its own (its results' structure):
    # the first run's all_reduce is #1 and its close #2
    second, last = ("#2", "all_reduce #1") if how == "check off" else ("#3", "strategy.run (result) #2")
    second_run = site("skip_collective.py", "    strategy.run(")  # the one rank 1 skips
    assert f"all_reduce (collective {second}, called at {second_run} in <lambda>)" in out, out
    assert "did not complete within its timeout of 5 s" in out, out
    assert f"waiting for rank 1: rank 1 is not in a collective (last finished {last}" in out, out
    assert f"it is at {site('skip_collective.py', 'time.sleep(60)')} in <module>" in out, out  # rank 1
    if how != "check off":  # the handshake is polled, so the waiting ranks raise
        assert "CollectiveTimeoutError" in out, out


def test_a_stall_in_a_steps_closing_handshake_under_step_times_out_naming_the_rank():
    """Under MPISTRAT_CHECK=step a step's closing handshake is the one collective of the step that
    sends a check (its all_reduce went unchecked): it is watched as any collective, so a rank that
    never reaches it is named, with where it is, within the timeout."""
    code, out = run_job(
        "step_close_stall.py", limit=20, env={"MPISTRAT_CHECK": "step", "MPISTRAT_TIMEOUT": "5"}
    )
    assert code != 0, out
    # 4 steps: the first checks its all_reduce (#1) and closes (#2); each later one defers its
    # all_reduce (#3, #5, #7) and closes (#4, #6, #8)
    run_site = site("step_close_stall.py", "    strategy.run(")
    closing = f"strategy.run (result) (collective #8, called at {run_site} in <module>)"
    assert f"{closing} did not complete within its timeout of 5 s" in out, out
    assert "waiting for rank 1: rank 1 is not in a collective (last finished all_reduce #7" in out, out
    assert f"it is at {site('step_close_stall.py', '        time.sleep(stall)')} in step" in out, out
    assert "#7 all_reduce [fp " in out and "unchecked until the step's closing handshake" in out, out


def test_a_stall_in_a_steps_compiled_closing_is_warned_of_naming_the_rank():
    """With the default timeout (not polled) a learned step closes through the compiled closing where
    it runs, which marks the watchdog's monitor as the Python one does: a rank late to it is named by
    the stall warning, with the closing's number and where the late rank is, and the job goes on."""
    env = {"MPISTRAT_CHECK": "step", "MPISTRAT_STALL_WARNING_SECONDS": "1"}
    code, out = run_job("step_close_stall.py", "8", limit=60, env=env)
    assert code == 0, out
    assert out.count("WARNING: strategy.run (result) (collective #8") == 1, out
    late = r"waited \d+ s: waiting for rank 1: rank 1 is not in a collective \(last finished all_reduce #7"
    assert re.search(late, out), out
    # the learned steps' closings (the 2nd to 4th), the stalled one included
    closings = "3 compiled" if step_check.chosen else "0 compiled"
    assert on_every_rank(out, f"finished, its closings {closings}"), out


def test_a_strategy_whose_handshake_timed_out_raises_at_its_next_collective():
    """A timed-out handshake may still be in flight (the persistent one is still active): calling
    again on that strategy raises at once, saying why, instead of starting it again, and
    finalizing the strategy leaves the request to MPI instead of freeing it while active."""
    code, out = run_job("timeout_then_again.py", limit=20)
    assert code != 0, out
    for r in (0, 2):
        assert f"rank {r} timed out" in out, out
        assert re.search(rf"rank {r} again: .*did not complete \(it timed out or was interrupted\)", out), out
        assert f"rank {r} finalized" in out, out


def test_below_thread_multiple_a_timeout_still_ends_the_job():
    code, out = run_job("skip_collective.py", limit=15, env={"MPI4PY_RC_THREAD_LEVEL": "funneled"})
    assert code != 0, out
    assert "CollectiveTimeoutError" in out and "which ranks are missing is unknown" in out, out


def test_a_killed_rank_ends_the_job():
    code, out = run_job("kill_rank.py", limit=5 + 10)
    assert code != 0, out
    assert "signal 9" in out or "Killed" in out or "timed out" in out, out


def test_a_killed_rank_ends_the_job_with_default_settings():
    """The launcher sees the process die and ends the job (Open MPI names the rank, MPICH its PID)."""
    code, out = run_job("kill_rank.py", "--default", limit=20)
    assert code != 0, out
    assert "signal 9" in out or "Killed" in out, out


def test_a_killed_rank_the_launcher_leaves_running_is_named_with_each_survivors_step():
    """Rank 1 is killed inside optimizer step 3 under a wrapper that outlives it by 60 s, so the
    launcher leaves the others running (as ``srun`` without ``--kill-on-bad-exit`` does). Rank 0,
    which watches it on this machine, sees its process end: every waiting rank names it and its own
    step at once, and the job ends with status 76, long before the wrapper would let it."""
    args = ["60", str(FAULTS / "survive.py"), "--steps", "4", "--kill", "1@2@inside"]
    code, out = run_job("linger.py", *args, limit=40)
    assert code == 76, out
    for r in (0, 2):
        said = rf"\[rank {r}\] mpistrat: rank 1 died during optimizer step 3 \(this rank had applied 2\): "
        seen = r"its process \(pid \d+\) ended without saying it leaves; apply_gradients"
        assert re.search(said + seen, out), out


def test_a_frozen_rank_is_named_as_not_answering():
    code, out = run_job("freeze_rank.py", limit=5 + 20)
    assert code != 0, out
    assert "waiting for rank 1: rank 1 did not answer within" in out, out


def test_a_frozen_coordinator_is_stood_in_for_and_every_waiting_rank_raises():
    """Rank 1 stands in for rank 0; the lowest waiting rank prints the diagnosis, the other points to it."""
    code, out = run_job("freeze_rank.py", "0", limit=5 + 25)
    assert code != 0, out
    explanation = re.compile(
        r"waiting for rank 0: rank 0 did not answer within \d s \(slow to answer, or killed, or blocked "
        r"outside Python\)\. Waiting in it: ranks 1, 2 \(rank 0 did not answer as the watchdog's "
        r"coordinator; rank 1 stood in\)"
    )
    assert len(explanation.findall(out)) == 1, out
    for r in (1, 2):
        assert f"[rank {r}] mpistrat.errors.CollectiveTimeoutError: all_reduce (collective #3" in out, out
    assert (
        "[rank 2] mpistrat.errors.CollectiveTimeoutError: " in out and "rank 1 prints who is missing" in out
    ), out


def test_merge_fn_error_reaches_every_rank_and_the_strategy_goes_on():
    code, out = run_job("merge_fn_raises.py", limit=30)
    assert code == 0, out
    assert on_every_rank(out, "raised StepFailed: merge_fn saw 3 replicas"), out
    assert on_every_rank(out, "after: ok"), out


def test_sys_exit_in_an_every_rank_merge_fn_ends_every_rank_with_its_status():
    """It used to end the job with "ranks are in different collectives" and MPI_Abort's status 1."""
    code, out = run_job("merge_fn_raises.py", "exit", limit=30)
    assert code == 3 and "went on" not in out and "different collectives" not in out, out
    said = re.findall(r"failed on rank 1, which left reduce .* waited: sys.exit\(3\)", out)
    assert len(said) == 1, out


def test_a_late_rank_gets_a_stall_warning_naming_it():
    code, out = run_job("stall_warning.py", limit=30, env={"MPISTRAT_STALL_WARNING_SECONDS": "1"})
    assert code == 0, out
    assert out.count("WARNING: all_reduce (collective #3") == 1, out  # from the lowest waiting rank only
    assert "[mpistrat rank 0] WARNING" in out, out
    # how long it has waited when the warning prints: the 1 s, and the diagnosis's round trip
    assert re.search(r"has waited [12] s: waiting for rank 2: rank 2 is not in a collective", out), out
    assert on_every_rank(out, "finished"), out


@pytest.mark.parametrize(
    ("ranks", "late", "freeze", "slow"),
    [
        (2, -1, False, 0),
        (3, -1, False, 0),
        (4, -1, False, 0),
        (4, 0, False, 0),
        (2, 0, True, 0),
        (4, 0, True, 0),
        (16, -1, False, 4),
    ],
    ids=["2-last", "3-last", "4-last", "4-first", "2-first-frozen", "4-first-frozen", "16-last-4-slow"],
)
def test_a_stall_costs_side_channel_messages_linear_in_the_ranks(ranks, late, freeze, slow):
    """One rank diagnoses a stall for everyone: per event at most one report, query, answer and result
    per other rank, 4(R-1). A frozen rank 0 (the coordinator) is passed over after a wait: one more
    report per waiting rank, and when it wakes it diagnoses the stale reports once: 8(R-1) in all.

    At 16 oversubscribed ranks, 4 of them alive but slow to answer, the warning still names only
    the late rank (it called slow ranks gone: "did not answer (it exited, ...)"), and the bytes stay
    O(R): the diagnosis's text goes to the rank that prints it, not to every waiting rank (17 KB,
    1.1 KB per rank, at 16 ranks; 0.44 KB per rank now).

    The job checks that one warning was logged, naming the late rank (tests/faults/stall_count.py).
    """
    args = [str(late)] + (["--freeze"] if freeze else []) + (["--slow", str(slow)] if slow else [])
    env = {"MPISTRAT_STALL_WARNING_SECONDS": "1"}
    code, out = run_job("stall_count.py", *args, limit=90, env=env, ranks=ranks)
    assert code == 0, out
    found = re.search(
        rf"side-channel messages for one stall at {ranks} ranks \(rank \d+ \w+\): (\d+), (\d+) bytes", out
    )
    assert found, out
    messages, nbytes = int(found.group(1)), int(found.group(2))
    assert 0 < messages <= (8 if freeze else 4) * (ranks - 1), out
    if not freeze:
        # each rank's flight record (at most 8 handshakes, strategy.run's closing ones among them) rides
        # in the diagnosis: a constant per rank
        assert nbytes <= 800 * ranks, out
    assert out.count(" WARNING: all_reduce (collective #3") == 1, out
    assert all(f"rank {r} finished" in out for r in range(ranks)), out


def test_idling_past_the_timeout_between_collectives_is_no_timeout():
    """A handshake outside a watched call used to inherit the last call's expired deadline."""
    code, out = run_job("idle_past_timeout.py", limit=40, env={"MPISTRAT_TIMEOUT": "1"})
    assert code == 0, out
    assert on_every_rank(out, "finished"), out
    assert "CollectiveTimeoutError" not in out and "MPI_Abort" not in out, out


def test_one_stall_in_a_merge_call_is_one_warning():
    code, out = run_job("merge_call_stall.py", limit=40, env={"MPISTRAT_STALL_WARNING_SECONDS": "1"})
    assert code == 0, out
    assert on_every_rank(out, "finished"), out
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "waiting for rank 0" in warnings[0], out


@pytest.mark.parametrize("what", ["dataset", "checkpoint", "variable"])
def test_every_collective_is_watched_a_missing_rank_times_out(what):
    """Dataset steps, checkpoint saves and variable creation used to open with an unwatched
    handshake: with a rank missing, nothing was printed and the job hung despite the timeout."""
    code, out = run_job("skip_other.py", what, limit=20, env={"MPISTRAT_TIMEOUT": "4"})
    assert code != 0, out
    assert "did not complete within its timeout of 4 s" in out, out
    assert "waiting for rank 1" in out, out


@pytest.mark.timeout(200)
def test_a_long_transfer_is_not_blamed_on_a_rank():
    """Every rank is inside one 300 MiB all_gather for longer than the stall warning. MPI holds up the
    watchdog's messages meanwhile (over 1 s, measured), so ranks answer late; the warning must not call
    them missing (it said "rank 1 did not answer (it exited, was killed, ...)").

    Sized to hold on a busy machine: in a CPU cgroup of 0.3 cores (each of the 3 ranks a tenth of a core,
    as at load 20 on 2 cores) it took 18 s, at 0.15 cores 33 s; 300 MiB per rank took 88 s there, past
    the 60 s limit it had then."""
    code, out = run_job("long_transfer.py", "100", limit=150, env={"MPISTRAT_STALL_WARNING_SECONDS": "0.3"})
    assert code == 0, out
    assert on_every_rank(out, "finished"), out
    assert "did not answer (" not in out and "waiting for rank" not in out, out
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    # The opening all_reduce may also wait 0.3 s on a loaded machine (ranks start unevenly): the
    # same rule holds for it, but only the all_gather is sure to be long.
    gather_warnings = [w for w in warnings if "all_gather" in w]
    took = max(float(t) for t in re.findall(r"gathered \S+ MiB in ([\d.]+) s", out))
    if took > 0.3 + 3 * side_channel.GRACE:  # long enough for a diagnosis: it says no rank is missing
        assert len(gather_warnings) == 1 and "every rank " in gather_warnings[0], out
    assert all("every rank " in w for w in warnings), out


@pytest.mark.parametrize("how", ["exit0", "exit3", "raise", "skip", "inside", "create"])
def test_a_rank_that_leaves_ends_the_job_at_once_naming_it(how):
    """With default settings the others used to wait forever (one warning at 60 s). Now the
    leaving rank's exit hook tells them, and they end the job naming it."""
    env = {"MPISTRAT_ABORT_ON_EXCEPTION": "0"} if how in ("raise", "inside") else {}
    code, out = run_job("rank_leaves.py", how, limit=30, env=env)
    assert code != 0, out
    assert "rank 0 finished" not in out and "rank 2 finished" not in out, out
    why = {"raise": "an uncaught ValueError", "inside": "an uncaught OSError"}.get(
        how, "sys.exit or the end of its program"
    )
    if how == "create":  # strategy creation (MPI_Comm_dup) is covered too
        pattern = (
            r"\[rank (\d)\] mpistrat: MPIStrategy\(\) cannot create its communicator \(MPI_Comm_dup, "
            rf"collective over the 3 ranks .*rank_leaves.py:\d+ in <module>\): world rank 1 exited \({why}\)"
        )
    else:
        pattern = (
            r"\[rank (\d)\] mpistrat: all_reduce \(collective #3, called at .*rank_leaves.py:\d+ "
            rf"in [<>\w]+\) cannot complete: rank 1 exited after collective #2 \({why}\)"
        )
    named = re.findall(pattern, out)
    assert named and set(named) <= {"0", "2"}, out


@pytest.mark.parametrize("how", ["exit", "slurm"])
def test_a_rank_that_fails_while_the_others_create_a_strategy_with_a_resolver_ends_the_job(how):
    """The resolver's check used to run a blocking Dup and allgather before the bounded creation:
    the others waited there for good. Now the creation comes first, bounded as without a resolver."""
    env = {"MPISTRAT_TIMEOUT": "3"} if how == "slurm" else {}
    code, out = run_job("resolver_rank_fails.py", how, limit=30, env=env)
    assert code != 0 and "created its strategy" not in out, out
    why = "world rank 1 exited" if how == "exit" else "did not complete within its timeout of 3 s"
    pattern = (
        rf"\[rank [02]\] mpistrat: MultiWorkerMirroredStrategy\(\) cannot create its communicator .*{why}"
    )
    assert re.search(pattern, out), out
    if how == "slurm":
        assert "Invalid tasks-per-node list format" in out, out  # rank 1's own error, with its traceback


@pytest.mark.parametrize("how", ["every", "early", "before_import"])
def test_collectives_in_exit_handlers_work_or_end_the_job_naming_what_is_missing(how):
    """A program's atexit handler reduces. Every rank doing so works; rank 1 returning early used
    to hang the others silently (mpistrat's hook had stopped the watchdog). Now its exit is seen
    and named, or, for a handler that runs after mpistrat's hook, the timeout ends the job."""
    code, out = run_job("exit_handler.py", how, limit=40)
    if how == "every":
        assert code == 0, out
        assert on_every_rank(out, f"exit handler total {[float(RANKS)] * 2}"), out
        return
    assert code != 0, out
    assert "rank 1 returns early" in out and "rank 0 exit handler" not in out, out
    headline = (  # the handler's strategy.run closes with collective #3 (the program's run: #1 and #2)
        r"\[rank [02]\] mpistrat: strategy\.run \(result\) \(collective #3, called at .*exit_handler.py:\d+ "
        r"in last_words\)"
    )
    if how == "early":
        assert re.search(headline + " cannot complete: rank 1 exited after collective #2", out), out
    else:
        assert re.search(
            headline + " did not complete within its timeout of 3 s; .*after mpistrat's exit hook", out
        ), out


def test_a_rank_stopped_for_good_ends_the_job_by_the_default_timeout():
    """The default timeout (30 minutes, shortened here by replacing the default itself, not by
    setting MPISTRAT_TIMEOUT) ends the job from the watchdog, naming the frozen rank."""
    code, out = run_job("freeze_rank.py", "1", "--default-timeout", "4", limit=40)
    assert code != 0, out
    assert "did not complete within its timeout of 4 s (MPISTRAT_TIMEOUT's default" in out, out
    assert "waiting for rank 1" in out, out


def test_a_hang_prints_every_ranks_flight_record_and_the_straggler_before_it():
    """Rank 1, late at every step, then hangs: the stall warning names it as the straggler, and the
    stall warning and the timeout show each rank's last handshakes (rank 1 finished step 20: its
    all_reduce #39 and strategy.run's closing #40; the others wait in #41's handshake)."""
    env = {"MPISTRAT_STALL_WARNING_SECONDS": "1"}
    code, out = run_job("straggler_hang.py", limit=4 + 15, env=env)
    assert code != 0, out
    warning = next((line for line in out.splitlines() if "WARNING: all_reduce (collective #41" in line), "")
    share = re.search(r"Before it, rank 1 was the last to arrive in (\d+)% of 20 collectives", warning)
    assert share and int(share[1]) >= 90, out  # late at every step; a loaded machine may delay another once
    timeout = out[out.index("CollectiveTimeoutError: all_reduce (collective #41") :]
    for text in (out[out.index(warning) :], timeout):
        records = text[text.index("flight records (each rank's last 8 handshakes, oldest first):") :]
        found = re.findall(r"^(?:\[rank \d\] )?  rank (\d): (.*)$", records, re.MULTILINE)[:3]
        assert [int(r) for r, _ in found] == [0, 1, 2], records
        lines = [line for _, line in found]
        assert "#39 all_reduce" in lines[1] and "#41" not in lines[1], records  # rank 1 never entered #41
        for waiting in (lines[0], lines[2]):
            assert waiting.split("; ")[-1].startswith("#41 all_reduce") and "in its handshake for" in waiting
    assert "[rank 0] mpistrat.errors.CollectiveTimeoutError" in out and "[rank 2] mpistrat" in out, out


@pytest.mark.parametrize(("late", "summary"), [("2", None), ("-1", None), ("2", "off")])
def test_the_end_of_job_summary_names_a_straggler_and_is_quiet_otherwise(tmp_path, late, summary):
    env = {"MPISTRAT_TIMELINE": str(tmp_path)}
    if summary:
        env["MPISTRAT_STRAGGLER_SUMMARY"] = summary
    code, out = run_job("stragglers_summary.py", late, limit=30, env=env)
    assert code == 0 and on_every_rank(out, "finished"), out
    # 50 ms late at every step: last far more often than chance (a third), though a loaded machine
    # deschedules another rank for tens of ms now and then; each step's all_reduce is tallied (the
    # last one too, by the closing handshake of its strategy.run)
    shares = [int(p) for p in re.findall(r"rank 2 was the last to arrive in (\d+)% of 31 collectives", out)]
    said = bool(shares)
    assert said == (late == "2" and summary is None), out
    assert all(share >= 60 for share in shares), out
    assert out.count("WARNING: stragglers over 3 ranks") == int(said), out  # rank 0 alone
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank-0000{r}.jsonl" for r in range(3)]
