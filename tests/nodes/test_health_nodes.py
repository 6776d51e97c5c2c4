"""``mpistrat info --health`` at two virtual nodes, one of them slowed by a CPU quota (serial pass only).

nodeb's ranks get a tenth of one CPU between them, and nodea's eight times the usual CPU weight,
so that other load on a shared machine does not slow the healthy node too (tests/support/nodes.py:
cgroups their proxies and ranks run in). make test-nodes runs this file alone, after the others.
"""

from __future__ import annotations

import json

import pytest

from tests.support import nodes

pytestmark = [pytest.mark.serial, pytest.mark.slow, nodes.needs_nodes]


def test_a_slowed_node_is_flagged_and_the_exclude_line_names_it():
    with nodes.cpu_group(quota=0.1) as slow, nodes.cpu_group(favoured=True) as healthy:
        code, out = nodes.run_job(
            ["-m", "mpistrat", "info", "--health", "--json"],
            cgroups={"nodea": healthy, "nodeb": slow},
            limit=150,
        )
    assert code != 0, out  # 1 on every rank (Intel MPI's mpiexec reports that as 255)
    report = json.loads(out[out.index("{") : out.rindex("}") + 1])
    assert list(report["nodes"]) == ["nodea", "nodeb"] and len(report["ranks"]) == 4, out
    assert list(report["flagged"]) == ["nodeb"] and report["exclude"] == "--exclude=nodeb", out
    assert set(report["flagged"]["nodeb"]) & {"startup", "imported", "compute", "memory"}, out
    assert "mpistrat info --health: slow node(s); --exclude=nodeb" in out, out
