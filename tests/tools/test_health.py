"""``mpistrat info --health``'s verdicts on made-up records (the arithmetic, by hand), and the command
at 1 and 2 ranks on one node (serial pass only). tests/nodes/test_health_nodes.py slows a real node."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from mpistrat.tools import health, health_report
from tests.support.launch import MPIEXEC, ROOT, job_environment, launcher_options


def rank(host: str, **changes: object) -> dict[str, object]:
    """A healthy rank's record: 1 s start-up, 0.5 s import, 10 GFLOP/s, 5 GB/s, no links."""
    record: dict[str, object] = dict(
        host=host, startup=1.0, imported=0.5, strategy=0.1, gflops=10.0, gbps=5.0
    )
    record["links"] = {}
    record.update(changes)
    return record


def test_a_node_whose_ranks_are_all_slow_is_flagged_and_one_slow_rank_is_not():
    ranks = [
        rank("a"),
        rank("a"),
        rank("b", gflops=2.0),
        rank("b", gflops=3.0),
        rank("c", gflops=1.0),
        rank("c"),
    ]
    nodes = health_report.per_node(ranks)
    assert nodes["b"]["compute"] == 3.0 and nodes["c"]["compute"] == 10.0  # the faster of two
    assert health_report.flagged(nodes) == {"b": ["compute"]}  # 1/3 of the median node's rate, and less


@pytest.mark.parametrize(
    ("slow", "flagged"),
    [(3.1, True), (2.9, False)],
    ids=["beyond-3x", "within-3x"],
)
def test_the_factor_is_against_the_lower_median_so_one_of_two_nodes_is_found(slow, flagged):
    nodes = health_report.per_node([rank("a", imported=0.5), rank("b", imported=0.5 * slow)])
    assert health_report.flagged(nodes) == ({"b": ["imported"]} if flagged else {})


def test_differences_below_a_metrics_resolution_are_noise():
    nodes = health_report.per_node([rank("a", imported=0.01), rank("b", imported=0.2)])  # 20x, 0.19 s
    assert health_report.flagged(nodes) == {}
    nodes = health_report.per_node([rank("a", imported=0.01), rank("b", imported=0.5)])
    assert health_report.flagged(nodes) == {"b": ["imported"]}


def test_start_up_and_strategy_creation_are_the_jobs_slowest_rank_and_flag_no_node():
    ranks = [rank("a", startup=2.0), rank("b", startup=9.0, strategy=0.4), rank("b", startup=None)]
    assert health_report.job(ranks) == {"startup": 9.0, "strategy": 0.4}
    assert health_report.flagged(health_report.per_node(ranks)) == {}


def test_a_failed_probe_flags_its_node_and_shows_as_unknown():
    nodes = health_report.per_node([rank("a"), rank("b", imported=None), rank("b", imported=None)])
    assert nodes["b"]["imported"] == math.inf
    assert health_report.flagged(nodes) == {"b": ["imported"]}


def test_a_link_counts_for_a_node_by_its_best_link():
    """Ring a-b-c-d: every link of c is slow; b and d each keep one good link."""
    ranks = [
        rank("a", links={"b": (2e-6, 1e-3)}),
        rank("b", links={"c": (9e-4, 1e-2)}),
        rank("c", links={"d": (9e-4, 1e-2)}),
        rank("d", links={"a": (2e-6, 1e-3)}),
    ]
    nodes = health_report.per_node(ranks)
    assert [nodes[h]["small"] for h in "abcd"] == [2e-6, 2e-6, 9e-4, 2e-6]
    assert health_report.flagged(nodes) == {"c": ["small", "large"]}


def test_the_table_names_every_node_and_ends_with_the_exclude_line():
    nodes = health_report.per_node([rank("n2", gflops=1.0), rank("n1"), rank("n3")])
    found = health_report.flagged(nodes)
    text = health_report.render(nodes, found, 3, {"startup": 2.5, "strategy": None})
    assert health_report.exclude_line({"n3": [], "n1": []}) == "--exclude=n1,n3"
    assert text.splitlines()[-1].endswith("leave them out with --exclude=n2"), text
    assert all(any(line.startswith(h) for line in text.splitlines()) for h in ("n1", "n2", "n3")), text
    assert "<- slow: compute" in text and "MPI_Init, to the check's first line: 2.50 s" in text


@pytest.mark.parametrize(
    ("n", "pairs"), [(2, [(0, 1)]), (3, [(0, 1), (1, 2)]), (4, [(0, 1), (2, 3), (1, 2), (3, 0)])]
)
def test_leaders_meet_each_neighbour_on_a_ring_once(n, pairs):
    met = [
        (me, partner)
        for round_ in (0, 1)
        for me in range(n)
        if (p := health._partner(me, n, round_)) is not None and p[1]
        for partner in [p[0]]
    ]
    assert met == pairs
    for round_ in (0, 1):  # partners agree, and exactly one of each pair sends first
        for me in range(n):
            p = health._partner(me, n, round_)
            if p is not None:
                assert health._partner(p[0], n, round_) == (me, not p[1])


@pytest.mark.serial
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_command_on_one_node_compares_nothing_and_exits_0(ranks):
    command = [sys.executable, "-m", "mpistrat", "info", "--health", "--json"]
    if ranks > 1:
        command = [str(MPIEXEC), *launcher_options(), "-n", str(ranks), *command]
    done = subprocess.run(
        command, env=job_environment(), capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert len(report["ranks"]) == ranks and len(report["nodes"]) == 1 and report["flagged"] == {}
    row = next(iter(report["nodes"].values()))
    assert row["imported"] > 0 and row["compute"] > 0 and row["memory"] > 0 and row["small"] is None
