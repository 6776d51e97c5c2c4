"""``CommunicationImplementation.HIERARCHICAL`` between virtual nodes, counted (serial pass only).

tests/nodes/jobs/hierarchical_counted.py records, per rank, its calls on the node's and the
leaders' communicators and its error against the exact sum; here every rank's record is checked.
"""

from __future__ import annotations

import json

import pytest

from tests.support import nodes

pytestmark = [pytest.mark.serial, nodes.needs_nodes]

LAYOUTS = {"2x2": nodes.TWO_NODES, "2+1+1": {"nodea": 2, "nodeb": 1, "nodec": 1}}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_only_leaders_send_between_nodes_compressed_halves_it_and_errors_stay_within_the_bound(layout):
    code, out = nodes.run_job(["tests/nodes/jobs/hierarchical_counted.py"], layout=LAYOUTS[layout], limit=90)
    assert code == 0, out
    reports = sorted(
        (json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda r: r["rank"]
    )
    hosts = [h for h, n in LAYOUTS[layout].items() for _ in range(n)]
    assert [r["host"] for r in reports] == hosts and {r["nodes"] for r in reports} == {
        len(LAYOUTS[layout])
    }, out
    leaders = {hosts.index(h) for h in set(hosts)}  # each node's first rank
    for r in reports:
        for case, c in r["cases"].items():
            dtype, codec = case.split()
            where = f"rank {r['rank']} on {r['host']}, {case}: {c}"
            assert c["dtype"] == dtype and c["of_bound"] <= 1.0, where
            assert c["node"] == (["Reduce", "Bcast"] if hosts.count(r["host"]) > 1 else []), where
            if r["rank"] not in leaders:
                assert c["leaders"] == [], where  # nothing between nodes from a rank that is no leader
                continue
            plain = r["cases"][f"{dtype} plain"]["leaders_ring_bytes"]
            if codec == "plain":
                assert c["leaders"] == ["Allreduce"] and c["of_rounding"] <= 1.0, where
            else:  # 16 bits between nodes: half a float32 ring all-reduce, a quarter of float64's
                assert c["leaders"] == ["Alltoall", "Allgather"], where
                assert c["leaders_ring_bytes"] <= (0.51 if dtype == "float32" else 0.26) * plain, where
                assert c["of_rounding"] > 1.0, where  # rounded to 16 bits: beyond float rounding


def test_an_overflow_between_nodes_names_the_ranks_of_the_node_not_the_leaders_numbering():
    """fp16 between the leaders; world rank 3 (nodeb) passes a value beyond 65504. The leaders'
    communicator numbers nodeb's leader 1: world rank 1 (nodea) did nothing wrong."""
    code, out = nodes.run_job(["tests/nodes/jobs/overflow_named.py", "3"], limit=60)
    assert code == 0, out
    named = "compression='fp16' overflowed on rank(s) [2, 3] (their node's sum, between nodes)"
    assert all(f"rank {r}: InvalidArgumentError: all_reduce: {named}" in out for r in range(4)), out
