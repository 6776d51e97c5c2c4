"""Staging at two virtual nodes, each with a ``/dev/shm`` of its own (``fake_ssh.sh``'s VNODE_SHM, kept
between jobs as a node's is): one task per node unpacks the pack there, as ``srun --ntasks-per-node=1``
does in jobs/, and every rank then runs from its own node's copy. Serial pass only."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from mpistrat.tools.stage import MANIFEST
from tests.support import nodes, staged

pytestmark = [pytest.mark.serial, nodes.needs_nodes, pytest.mark.slow]

STAGED = "/dev/shm/mpistrat-stage"  # the same path on every node, each node's own directory
# Each rank: its host, whose copy it runs (the NODE file the test leaves in each), where Python,
# numpy, mpi4py and mpistrat came from, and a sum over both nodes.
REPORT = """
import json, socket, sys
import numpy, mpi4py.MPI, mpistrat
strategy = mpistrat.MPIStrategy()
total = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", numpy.ones(2)))
paths = [sys.prefix, sys.base_prefix, numpy.__file__, mpi4py.MPI.__file__, mpistrat.__file__]
copy = open(sys.prefix + "/NODE").read()
report = {"host": socket.gethostname(), "copy": copy, "paths": paths, "total": total.tolist()}
json.dump(report, open(f"{sys.argv[1]}/rank-{strategy.extended.rank}.json", "w"))
"""


def test_each_node_stages_its_own_copy_and_its_ranks_run_from_it():
    pack = staged.pack()
    memory = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    shm = Path(tempfile.mkdtemp(prefix="vnodes-", dir=memory))
    work = Path(tempfile.mkdtemp(prefix="vnodes-job-"))  # outside /dev/shm, which each node has of its own
    try:
        one_per_node = {"nodea": 1, "nodeb": 1}
        unpack = ["-m", "mpistrat", "stage", "--unpack", str(pack), STAGED]
        code, out = nodes.run_job(
            unpack, layout=one_per_node, env={"VNODE_SHM": str(shm), "MPI4PY_RC_INITIALIZE": "0"}, limit=600
        )
        assert code == 0, out
        for host in one_per_node:
            copy = shm / host / Path(STAGED).name / "venv"
            assert json.loads((copy / MANIFEST).read_text())["unpacked"] == STAGED
            (copy / "NODE").write_text(host)
        (work / "job.py").write_text(REPORT)  # a script, not -c: the repository is not on its path
        code, out = nodes.run_job(
            [str(work / "job.py"), str(work)],
            env={"VNODE_SHM": str(shm), "PYTHONPATH": ""},
            python=f"{STAGED}/venv/bin/python",
            limit=120,
        )
        assert code == 0, out
        ranks = [json.loads((work / f"rank-{rank}.json").read_text()) for rank in range(4)]
        assert sorted(r["host"] for r in ranks) == ["nodea", "nodea", "nodeb", "nodeb"], out
        for r in ranks:
            assert r["copy"] == r["host"] and r["total"] == [4.0, 4.0], r
            assert r["paths"][:2] == [f"{STAGED}/venv", f"{STAGED}/base"], r
            assert all(p.startswith(f"{STAGED}/") for p in r["paths"][2:]), r
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
