"""A job at 64 oversubscribed ranks: every per-step operation right, no straggler, no per-rank noise."""

import pytest

from tests.diagnostics.test_faults import run_job
from tests.support.launch import is_open_mpi

RANKS = 64


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.serial
@pytest.mark.skipif(is_open_mpi(), reason="the MPICH suite runs it; Open MPI's launcher is slower at 64")
def test_64_ranks_all_reduce_all_gather_optimizer_and_merge_call_against_numpy():
    code, out = run_job("smoke_at_scale.py", limit=240, ranks=RANKS)
    assert code == 0, out
    assert f"smoke at {RANKS} ranks: all checked against NumPy" in out, out
    assert "straggler" not in out, out
    assert len(out.splitlines()) < 8, out  # one line from rank 0, nothing per rank
