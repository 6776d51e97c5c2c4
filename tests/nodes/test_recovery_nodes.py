"""A whole node's ranks lost at once, at two virtual nodes x 2 ranks (Open MPI with ULFM, over TCP).

The keepers of sharded slots are on the other node (``keeper_shift``: the most ranks on one node),
so both ranks of a node may die together and nothing is lost; the survivors on the other node end
with the weights of a NumPy run that lost nothing (``tests/distribute/test_recovery.py``). A node
whose daemon dies too is another matter: PRRTE ends the job ("lost communication with a remote
daemon"), whatever ULFM could do; said, and bounded.
"""

from __future__ import annotations

import pytest

from tests.distribute.test_recovery import JOB, check_result
from tests.support import launch, nodes

pytestmark = [
    pytest.mark.serial,
    nodes.needs_nodes,
    pytest.mark.skipif(not launch.is_open_mpi(), reason="ULFM recovery needs Open MPI 5 (--with-ft ulfm)"),
]
ULFM = ["--with-ft", "ulfm", "--mca", "pml", "ob1", "--mca", "btl", "self,tcp"]


def test_a_whole_node_lost_at_once_loses_no_sharded_state():
    kill = ["--kill", "2@2@inside", "--kill", "3@2@inside"]  # nodeb's two ranks
    _, out = nodes.run_job([str(JOB), "--steps", "4", "--shard", *kill], limit=90, options=ULFM)
    check_result(out, 4, {2, 3}, steps=4)
    assert "lost world ranks 2, 3; going on from optimizer step 2 with 2 of 4 replicas" in out, out


@pytest.mark.extended  # not in CI's make test-nodes (FAULTS_MARK): a bound on PRRTE, not ours
def test_a_node_whose_daemon_dies_ends_the_job():
    kill = ["--kill", "2@2@node", "--kill", "3@2@node"]  # the ranks and their node's daemon
    _, out = nodes.run_job([str(JOB), "--steps", "4", *kill], limit=90, options=ULFM)
    assert "PRTE has lost communication with a remote daemon" in out, out
    assert "RESULT" not in out, out
