"""Fault jobs at two virtual nodes x 2 ranks (tests/support/nodes.py): diagnoses name the host of the
missing rank, aborts and kills end the job on both nodes, and no job leaves a process behind
(``nodes.run_job`` fails the test otherwise). Ranks 0, 1 run on nodea, ranks 2, 3 on nodeb.
Serial pass only; each job has a hard time limit."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.support import nodes

pytestmark = [pytest.mark.serial, pytest.mark.slow, nodes.needs_nodes]

FAULTS = "tests/faults"


def test_a_stall_warning_names_the_late_ranks_host():
    code, out = nodes.run_job(
        ["tests/nodes/jobs/late_rank.py", "3"], limit=40, env={"MPISTRAT_STALL_WARNING_SECONDS": "1"}
    )
    assert code == 0 and all(f"rank {r} finished" in out for r in range(4)), out
    # #2 is the first strategy.run's closing handshake
    assert out.count("WARNING: all_reduce (collective #3") == 1, out
    assert "waiting for rank 3: rank 3 on nodeb is not in a collective" in out, out


def test_a_timeout_names_the_missing_ranks_host():
    code, out = nodes.run_job([f"{FAULTS}/skip_collective.py"], limit=30)
    assert code != 0, out
    assert "did not complete within its timeout of 5 s" in out, out
    assert "waiting for rank 1: rank 1 on nodea is not in a collective" in out, out


def test_a_frozen_rank_on_the_other_node_is_named_with_its_host():
    code, out = nodes.run_job([f"{FAULTS}/freeze_rank.py", "2"], limit=40)
    assert code != 0, out
    assert "waiting for rank 2: rank 2 on nodeb did not answer within" in out, out


def test_a_rank_that_exits_is_named_with_its_host_and_the_job_ends():
    code, out = nodes.run_job([f"{FAULTS}/rank_leaves.py", "exit0"], limit=40)
    assert code != 0, out
    assert re.search(
        r"cannot complete: rank 1 on nodea exited after collective #2", out
    )  # the run's closing handshake, out
    assert "rank 0 finished" not in out and "rank 3 finished" not in out, out


@pytest.mark.parametrize("script", ["raise_in_run.py", "kill_rank.py"])
def test_an_abort_or_a_killed_rank_ends_the_job_on_both_nodes(script):
    code, out = nodes.run_job([f"{FAULTS}/{script}"], limit=40)
    assert code != 0, out
    if script == "raise_in_run.py":
        assert "[rank 1] RuntimeError: boom on rank 1" in out and "calling MPI_Abort" in out, out


def test_the_straggler_summary_names_the_stragglers_host(tmp_path):
    code, out = nodes.run_job(
        [f"{FAULTS}/stragglers_summary.py", "3"], limit=40, env={"MPISTRAT_TIMELINE": str(tmp_path)}
    )
    assert code == 0, out
    # 50 ms late at every step: last far more often than chance (25%), though jobs running beside
    # this one on the two cores deschedule the others for tens of ms now and then
    shares = re.findall(r"rank 3 on nodeb was the last to arrive in (\d+)% of 31 collectives", out)
    assert shares and int(shares[0]) >= 60, out
    table = out[out.index("last arrivals over") :]
    assert re.search(r"^\s+3 nodeb\s+\d+", table, re.MULTILINE), table  # the host column
    flagged = [line.split()[0] for line in table.splitlines() if line.endswith("<- straggler")]
    assert flagged == ["3"], table


def test_a_preempted_job_saves_once_across_nodes_and_resumes_to_the_uninterrupted_weights(tmp_path):
    """SIGUSR1 reaches rank 2 (nodeb) during run call 5; every rank on both nodes stops after the same
    call, one checkpoint is written, and the resumed job ends with the weights of a job never stopped."""
    steps, at = 12, 5

    def train(name, *signal_args):
        args = [f"{FAULTS}/preempted_training.py", str(tmp_path / name), str(tmp_path / f"{name}.npy")]
        return nodes.run_job([*args, str(steps), *signal_args], limit=60, env={"SLURM_JOB_ID": ""})

    code, out = train("plain")
    assert code == 0, out
    code, out = train("job", "USR1", "2", str(at))
    stops = {int(r): int(n) for r, n in re.findall(r"rank (\d+) stopped after run call (\d+)", out)}
    assert code != 0 and sorted(stops) == [0, 1, 2, 3] and len(set(stops.values())) == 1, out
    assert "MPI_Abort" not in out and "cannot complete" not in out, out
    code, out = train("job")
    assert code == 0 and f"continuing after run call {stops[0]}" in out, out
    np.testing.assert_array_equal(np.load(tmp_path / "job.npy"), np.load(tmp_path / "plain.npy"))
