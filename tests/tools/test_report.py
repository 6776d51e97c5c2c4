"""``mpistrat report``: the rows table, the scaling table and the regression gate, on files built by hand.

Every expectation is written out here from the definitions (strong: speed-up T0/Tn,
efficiency T0·n0/(n·Tn); weak: efficiency T0/Tn, speed-up efficiency·n/n0), not recomputed
with the code under test.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from mpistrat.tools import bench_report, report, report_gate
from tests.tools.test_bench import SMALL, mpiexec, mpiexec_env

pytestmark = pytest.mark.serial(
    "JSON files in, tables and a gate out: nothing here depends on the number of ranks"
)

RANK = MPI.COMM_WORLD.Get_rank()


def _side(avg: float, nbytes: int, p50: float | None = None, p99: float | None = None) -> dict:
    return {
        "time_us": {"min": avg, "avg": avg, "max": avg, "p50": avg if p50 is None else p50, "p99": p99},
        "algbw_GBps": nbytes / (avg * 1e-6) / 1e9 if avg else 0.0,
        "busbw_GBps": nbytes / (avg * 1e-6) / 1e9 if avg else 0.0,
        "ok": True,
    }


def bench_file(path: Path, ranks: int, scaling: str, times: dict, dtype: str = "float32") -> str:
    """A results file as `mpistrat bench --json` writes it; ``times`` maps (op, bytes) to
    (mpistrat mean, raw mean) or (mpistrat mean, raw mean, p50, p99) in µs."""
    rows = []
    for (op, nbytes), t in times.items():
        ours, raw, p50, p99 = (*t, None, None)[:4] if len(t) == 2 else t
        rows.append(
            {
                "op": op,
                "bytes": nbytes,
                "count": nbytes // 4,
                "leaves": 1,
                "dtype": dtype,
                "ranks": ranks,
                "iters": 5,
                "warmup": 1,
                "mpistrat": _side(ours, nbytes, p50, p99),
                "raw": _side(raw, nbytes),
                "raw2": None,
                "ratio": ours / raw,
                "ratio2": None,
            }
        )
    meta = {"label": f"{ranks} ranks", "ranks": ranks, "nodes": 1, "hosts": ["h"], "scaling": scaling}
    path.write_text(json.dumps({"format": bench_report.FORMAT, "meta": meta, "results": rows}))
    return str(path)


@pytest.fixture
def here(tmp_path):
    """A folder of this rank's own (several ranks run the suite side by side)."""
    folder = tmp_path / f"rank{RANK}"
    folder.mkdir()
    return folder


MIB4 = 4 << 20


def test_strong_scaling_table_by_hand(here):
    files = [
        bench_file(here / "s1.json", 1, "strong", {("train_step", MIB4): (100.0, 90.0)}),
        bench_file(here / "s2.json", 2, "strong", {("train_step", MIB4): (60.0, 50.0)}),
        bench_file(here / "s4.json", 4, "strong", {("train_step", MIB4): (40.0, 30.0)}),
    ]
    table = report.scaling_table([bench_report.load(f) for f in files])
    got = [(r["ranks"], r["time_us"], r["speedup"], r["efficiency"]) for r in table]
    # speed-up 100/60, 100/40; efficiency = speed-up * 1/n
    want = [(1, 100.0, 1.0, 1.0), (2, 60.0, 5 / 3, 5 / 6), (4, 40.0, 2.5, 0.625)]
    assert [r[0] for r in got] == [r[0] for r in want]
    for g, w in zip(got, want, strict=True):
        assert g[1:] == pytest.approx(w[1:], rel=1e-12)
    assert [r["raw_speedup"] for r in table] == pytest.approx([1.0, 1.8, 3.0], rel=1e-12)
    assert [r["raw_efficiency"] for r in table] == pytest.approx([1.0, 0.9, 0.75], rel=1e-12)
    assert {r["mode"] for r in table} == {"strong"} and {r["op"] for r in table} == {"train_step"}


def test_the_scaling_table_gives_the_start_of_the_slowest_rank_beside_the_time(here, capsys):
    """The mean over a rank count's runs of their slowest rank's start (meta.startup), '-' where a run
    did not record it."""
    files = [
        bench_file(here / "a.json", 1, "strong", {("train_step", MIB4): (100.0, 90.0)}),
        bench_file(here / "b.json", 2, "strong", {("train_step", MIB4): (60.0, 50.0)}),
        bench_file(here / "c.json", 2, "strong", {("train_step", MIB4): (60.0, 50.0)}),
        bench_file(here / "d.json", 4, "strong", {("train_step", MIB4): (40.0, 30.0)}),
    ]
    for path, slowest in zip(files[:3], (1.25, 2.0, 3.0), strict=True):
        data = json.loads(Path(path).read_text())
        data["meta"]["startup"] = {
            "summary": {"first collective": {"median": 1.0, "slowest": slowest, "rank": 0}}
        }
        Path(path).write_text(json.dumps(data))
    table = report.scaling_table([bench_report.load(f) for f in files])
    assert [(r["ranks"], r["startup_s"]) for r in table] == [(1, 1.25), (2, 2.5), (4, None)]
    assert report.main([*files, "--markdown", str(here / "t.md")]) == 0
    markdown = (here / "t.md").read_text()
    assert "| raw efficiency | startup s |" in markdown and "| 2.50 |" in markdown and "| - |" in markdown, (
        markdown
    )
    capsys.readouterr()


def test_weak_scaling_from_two_ranks_with_repeated_runs(here):
    """n0 is the smallest rank count (2 here); two runs at 4 ranks count as their mean."""
    files = [
        bench_file(here / "w2.json", 2, "weak", {("all_reduce", 1024): (50.0, 40.0)}),
        bench_file(here / "w4a.json", 4, "weak", {("all_reduce", 1024): (60.0, 40.0)}),
        bench_file(here / "w4b.json", 4, "weak", {("all_reduce", 1024): (65.0, 40.0)}),
        bench_file(here / "w8.json", 8, "weak", {("all_reduce", 1024): (80.0, 50.0)}),
    ]
    table = report.scaling_table([bench_report.load(f) for f in files])
    assert [(r["ranks"], r["runs"]) for r in table] == [(2, 1), (4, 2), (8, 1)]
    # efficiency T0/Tn: 50/62.5 = 0.8, 50/80 = 0.625; speed-up efficiency * n/n0: 1.6, 2.5
    assert [r["time_us"] for r in table] == pytest.approx([50.0, 62.5, 80.0])
    assert [r["efficiency"] for r in table] == pytest.approx([1.0, 0.8, 0.625])
    assert [r["speedup"] for r in table] == pytest.approx([1.0, 1.6, 2.5])
    assert [r["raw_efficiency"] for r in table] == pytest.approx([1.0, 1.0, 0.8])


def test_the_scaling_table_picks_train_step_and_the_largest_common_size(here):
    rows1 = {
        ("all_reduce", 4): (10.0, 5.0),
        ("train_step", 1024): (8.0, 4.0),
        ("train_step", 2048): (9.0, 4.0),
    }
    rows2 = {("all_reduce", 4): (12.0, 6.0), ("train_step", 1024): (5.0, 3.0)}
    runs = [
        bench_report.load(bench_file(here / "a.json", 1, "strong", rows1)),
        bench_report.load(bench_file(here / "b.json", 2, "strong", rows2)),
    ]
    table = report.scaling_table(runs)
    assert [(r["op"], r["bytes"], r["ranks"]) for r in table] == [
        ("train_step", 1024, 1),
        ("train_step", 1024, 2),
    ]
    assert table[1]["speedup"] == pytest.approx(8 / 5)
    chosen = report.scaling_table(runs, op="all_reduce")
    assert [r["efficiency"] for r in chosen] == pytest.approx([1.0, 10 / 12 / 2])


ROWS = {("all_reduce", 4): (10.0, 5.0), ("all_reduce", 1024): (20.0, 10.0), ("all_gather", 4): (30.0, 15.0)}


def _gate(here, capsys, now: dict, reference: dict, *extra: str, ranks: int = 2) -> tuple[int, str]:
    new = bench_file(here / "new.json", ranks, "weak", now)
    ref = bench_file(here / "ref.json", 2, "weak", reference)
    code = report.main([new, "--reference", ref, "--quiet", *extra])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_file_against_itself_passes_the_gate(here, capsys):
    path = bench_file(here / "same.json", 2, "weak", ROWS)
    assert report.main([path, "--reference", path, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "gate passed: 3 row(s) compared" in out and "SLOWER" not in out and "missing" not in out


def test_a_2x_regression_fails_the_gate_naming_the_row_with_both_numbers(here, capsys):
    slower = {**ROWS, ("all_reduce", 1024): (40.0, 10.0)}  # 20 us -> 40 us
    code, out = _gate(here, capsys, slower, ROWS)
    assert code == 1
    assert "SLOWER: all_reduce 1 KiB float32 at 2 ranks: 40.00 us against 20.00 us" in out
    assert out.count("SLOWER") == 1
    assert "gate FAILED: 3 row(s) compared" in out and "1 slower" in out


def test_the_tolerance_is_a_fraction_of_the_reference(here, capsys):
    # 20 -> 21.8 is 1.09x: inside 10 %; 20 -> 22.2 is 1.11x: outside it, inside 20 %
    assert _gate(here, capsys, {**ROWS, ("all_reduce", 1024): (21.8, 10.0)}, ROWS)[0] == 0
    assert _gate(here, capsys, {**ROWS, ("all_reduce", 1024): (22.2, 10.0)}, ROWS)[0] == 1
    assert (
        _gate(here, capsys, {**ROWS, ("all_reduce", 1024): (22.2, 10.0)}, ROWS, "--tolerance", "0.2")[0] == 0
    )
    # faster is never a regression
    assert _gate(here, capsys, {k: (v[0] / 3, v[1]) for k, v in ROWS.items()}, ROWS)[0] == 0


def test_the_gate_can_compare_the_median(here, capsys):
    now = {k: (v[0] * 2, v[1], v[0], None) for k, v in ROWS.items()}  # mean doubled, median unchanged
    ref = {k: (v[0], v[1], v[0], None) for k, v in ROWS.items()}
    assert _gate(here, capsys, now, ref)[0] == 1
    assert _gate(here, capsys, now, ref, "--metric", "p50")[0] == 0
    code, out = _gate(here, capsys, now, ref, "--metric", "p99")
    assert code == 2 and "has no p99" in out


def test_missing_rows_are_listed_on_both_sides(here, capsys):
    now = {("all_reduce", 4): (10.0, 5.0), ("merge_call", 4): (50.0, 20.0)}
    code, out = _gate(here, capsys, now, ROWS)
    assert code == 0
    assert "1 row(s) compared" in out
    assert "missing: 1 row(s) not in the reference: merge_call 4 B float32 at 2 ranks" in out
    assert (
        "missing: 2 row(s) only in the reference: all_reduce 1 KiB float32 at 2 ranks; all_gather 4 B" in out
    )


def test_rows_at_another_rank_count_or_dtype_do_not_match(here, capsys):
    code, out = _gate(here, capsys, ROWS, ROWS, ranks=4)
    assert code == 1 and "no row matched" in out and "nothing was compared" in out


def test_the_gate_decision_itself():
    key = ("all_reduce", 4, 2, "float32")
    assert report_gate.gate({key: 20.0}, {key: 10.0}, 0.10).slower == [(key, 20.0, 10.0)]
    assert report_gate.gate({key: 11.0}, {key: 10.0}, 0.10).passed
    assert not report_gate.gate({}, {key: 10.0}, 0.10).passed


def test_csv_and_markdown_files(here, capsys):
    files = [
        bench_file(here / "s1.json", 1, "strong", {("train_step", MIB4): (100.0, 90.0)}),
        bench_file(here / "s2.json", 2, "strong", {("train_step", MIB4): (60.0, 50.0, 58.0, 70.0)}),
    ]
    out_csv, out_md = here / "eff.csv", here / "eff.md"
    assert report.main([*files, "--csv", str(out_csv), "--markdown", str(out_md)]) == 0
    printed = capsys.readouterr().out
    assert "strong scaling of train_step at 4 MiB, relative to 1 rank" in printed
    rows = list(csv.DictReader(out_csv.open()))
    assert [r["ranks"] for r in rows] == ["1", "2"]  # one row per rank count
    assert list(rows[0]) == list(report.SCALING_COLUMNS)
    assert float(rows[1]["speedup"]) == pytest.approx(100 / 60) and float(
        rows[1]["efficiency"]
    ) == pytest.approx(100 / 120)
    md = out_md.read_text()
    assert "| ranks | runs | time us | speed-up | efficiency |" in md
    assert "| 2 | 1 | 60.00 | 1.67 | 0.83 | 50.00 | 1.80 | 0.90 |" in md
    # the rows table: the one file at 1 rank has no p99, the other 70 us
    assert "| train_step | 4 MiB | 2 | float32 | 60.00 | 58.00 | 70.00 | 1.20 |" in md
    assert "| train_step | 4 MiB | 1 | float32 | 100.00 | 100.00 | - | 1.11 |" in md


def test_one_rank_count_writes_the_rows_table(here, capsys):
    path = bench_file(here / "one.json", 2, "weak", ROWS)
    out_csv = here / "rows.csv"
    assert report.main([path, "--csv", str(out_csv), "--quiet"]) == 0
    rows = list(csv.DictReader(out_csv.open()))
    assert [(r["op"], r["bytes"], r["mean_us"]) for r in rows] == [
        ("all_reduce", "4", "10.0"),
        ("all_reduce", "1024", "20.0"),
        ("all_gather", "4", "30.0"),
    ]
    assert rows[0]["p99_us"] == ""  # no p99: empty, not 0
    out = here / "one-eff.csv"
    assert report.main([path, "--csv", str(out), "--table", "scaling", "--op", "all_reduce", "--quiet"]) == 0
    assert [r["efficiency"] for r in csv.DictReader(out.open())] == ["1.0"]


def test_bad_inputs_are_reported_not_raised(here, capsys):
    other = here / "other.json"
    other.write_text('{"hello": 1}')
    assert report.main([str(other)]) == 2
    assert "not a results file of mpistrat bench" in capsys.readouterr().err
    path = bench_file(here / "x.json", 2, "weak", ROWS)
    assert report.main([path, "--reference", path, "--tolerance", "-1"]) == 2
    assert "--tolerance" in capsys.readouterr().err
    assert report.main([path, "--table", "scaling", "--op", "nope"]) == 2
    assert "not in every results file" in capsys.readouterr().err


def test_an_empty_results_list_is_a_file_with_no_rows(here, capsys):
    empty = bench_file(here / "empty.json", 2, "weak", {})
    assert report.main([empty]) == 0
    assert "no rows" in capsys.readouterr().out
    full = bench_file(here / "full.json", 2, "weak", ROWS)
    code = report.main([empty, "--reference", full])
    out = capsys.readouterr().out
    assert code == 1 and "gate FAILED: no row matched" in out, out


def test_a_reference_time_of_zero_is_refused_naming_the_row(here, capsys):
    zero = bench_file(here / "zero.json", 2, "weak", {**ROWS, ("all_reduce", 1024): (0.0, 10.0)})
    now = bench_file(here / "now.json", 2, "weak", ROWS)
    assert report.main([now, "--reference", zero, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "zero.json: all_reduce 1 KiB float32 at 2 ranks has a mean time of 0 us" in err, err


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -5.0])
def test_a_time_that_is_not_a_time_fails_the_gate(here, capsys, bad):
    """A NaN (or infinite, or negative) time is a broken measurement: never "gate passed"."""
    now = bench_file(here / "now.json", 2, "weak", {**ROWS, ("all_reduce", 1024): (bad, 10.0)})
    ref = bench_file(here / "ref.json", 2, "weak", ROWS)
    code = report.main([now, "--reference", ref, "--quiet"])
    out = capsys.readouterr()
    assert code == 2 and "gate passed" not in out.out, out.out
    assert f"all_reduce 1 KiB float32 at 2 ranks has a mean time of {bad:g} us" in out.err, out.err


@pytest.mark.parametrize("tolerance", ["nan", "inf", "-0.1"])
def test_a_tolerance_that_is_not_a_fraction_is_refused(here, capsys, tolerance):
    slower = bench_file(here / "slower.json", 2, "weak", {k: (v[0] * 10, v[1]) for k, v in ROWS.items()})
    ref = bench_file(here / "ref.json", 2, "weak", ROWS)
    assert report.main([slower, "--reference", ref, f"--tolerance={tolerance}", "--quiet"]) == 2
    assert "--tolerance: expected a finite fraction >= 0" in capsys.readouterr().err


def test_no_matching_row_is_one_verdict_failed(here, capsys):
    code, out = _gate(here, capsys, ROWS, ROWS, ranks=4)
    assert code == 1 and "gate passed" not in out and out.count("gate FAILED") == 1, out


def test_oversubscribed_runs_are_flagged_in_both_tables(here, capsys):
    """Rows of a run with more ranks than cores on a host carry a mark and a note saying so; a file
    written before bench recorded it is judged by its ranks against rank 0's cores on one node."""
    files = [
        bench_file(here / "r1.json", 1, "strong", {("all_reduce", 4): (10.0, 5.0)}),
        bench_file(here / "r4.json", 4, "strong", {("all_reduce", 4): (5600.0, 50.0)}),
    ]
    data = json.loads(Path(files[1]).read_text())
    data["meta"]["oversubscribed"] = ["4 ranks on 2 logical cores of h"]
    Path(files[1]).write_text(json.dumps(data))
    old = bench_file(here / "old.json", 8, "strong", {("all_reduce", 4): (900.0, 50.0)})
    data = json.loads(Path(old).read_text())
    data["meta"]["cpu"] = {"model": "x", "logical_cores": 2}  # no "oversubscribed": an older file
    Path(old).write_text(json.dumps(data))
    out_csv = here / "scaling.csv"
    assert report.main([*files, old, "--csv", str(out_csv)]) == 0
    out = capsys.readouterr().out
    assert "4 ranks on 2 logical cores of h" in out and "8 ranks on 2 logical cores of h" in out, out
    assert "1 rank on" not in out
    scaling = {r["ranks"]: r["oversubscribed"] for r in csv.DictReader(out_csv.open())}
    assert scaling == {"1": "False", "4": "True", "8": "True"}, scaling
    marked = [line for line in out.splitlines() if re.search(r"(^|\s)[48]\*\s", line)]
    assert len(marked) == 4, out  # the 4- and 8-rank rows of the scaling table and of the rows tables


@pytest.mark.serial
def test_report_of_real_runs_at_one_and_two_ranks(tmp_path):
    paths = []
    for ranks in (1, 2):
        path = tmp_path / f"bench-{ranks}.json"
        cmd = [*mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpistrat", "bench", *SMALL]
        cmd += [
            "--ops",
            "all_reduce,train_step",
            "--batch",
            "4",
            "--scaling",
            "strong",
            "--json",
            str(path),
            "--quiet",
        ]
        done = subprocess.run(cmd, env=mpiexec_env(), capture_output=True, text=True, timeout=110)
        assert done.returncode == 0, done.stderr[-3000:]
        paths.append(str(path))
    out = tmp_path / "efficiency.csv"
    cmd = [sys.executable, "-m", "mpistrat", "report", *paths, "--csv", str(out), "--reference", paths[0]]
    done = subprocess.run(cmd, env=mpiexec_env(), capture_output=True, text=True, timeout=110)
    # the 2-rank rows are not in the 1-rank reference; the 1-rank rows match themselves
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "strong scaling of train_step" in done.stdout and "row(s) only in" not in done.stdout
    assert "row(s) not in the reference" in done.stdout
    assert [r["ranks"] for r in csv.DictReader(out.open())] == ["1", "2"]


def test_a_sweep_without_a_scaling_mode_is_not_called_weak_scaling(here, capsys):
    """bench records no mode unless --scaling is given; report says a sweep, and tabulates it as weak
    (each rank's message size was fixed)."""
    files = [
        bench_file(here / f"sweep-{n}.json", n, None, {("all_reduce", 1024): (10.0 * n, 9.0 * n)})
        for n in (1, 2)
    ]
    assert report.main([*files]) == 0
    out = capsys.readouterr().out
    assert "weak scaling of" not in out and "sweeps (no --scaling; computed as weak scaling)" in out, out
    rows = report.scaling_table([bench_report.load(f) for f in files])
    assert [(r["mode"], r["ranks"], r["efficiency"]) for r in rows] == [("sweep", 1, 1.0), ("sweep", 2, 0.5)]


def test_a_files_warnings_are_carried_and_the_p99_note_said_once(here, capsys):
    """What bench warned about (a busy host, rows whose mean is over twice their median, a sweep a
    signal stopped) is printed under the file's title, in bench's words; the note on p99 '-' comes
    once after every file, not once per file."""
    busy = bench_file(here / "busy.json", 2, None, {("all_reduce", 4): (1476.0, 9.0, 320.0, None)})
    data = json.loads(Path(busy).read_text())
    data["meta"]["load"] = [
        {"host": "h", "ranks": 2, "cores": 2, "logical_cores": 2, "loadavg_before": [10.2, 9.0, 8.0]}
    ]
    data["meta"]["partial"] = "stopped by SIGTERM after 1 of its 19 sizes (18 not measured)"
    Path(busy).write_text(json.dumps(data))
    quiet = bench_file(here / "quiet.json", 2, None, {("all_reduce", 8): (10.0, 9.0, 10.0, None)})
    assert report.main([busy, quiet, "--csv", str(here / "rows.csv")]) == 0
    out = capsys.readouterr().out
    said = bench_report.warnings(data["meta"], data["results"])
    assert len(said) == 3 and all(f"WARNING: {w}" in out for w in said), out
    assert "h was busy: the load average was 10.2 before the sweep, with 0 of its 2 logical cores" in said[0]
    assert said[1].startswith("1 row(s) marked 'skewed'") and said[2].startswith("partial results: stopped")
    assert out.index("WARNING") > out.index("busy.json") and out.count("WARNING") == 3, out
    assert out.count("p99 '-'") == 1 and out.rstrip().endswith("before percentiles."), out
    rows = {r["bytes"]: r["skewed"] for r in csv.DictReader((here / "rows.csv").open())}
    assert rows == {"4": "True", "8": "False"}, rows


def test_a_dash_writes_the_markdown_or_csv_to_standard_output(here, capsys):
    one = bench_file(here / "one.json", 2, None, {("all_reduce", 4): (10.0, 9.0)})
    assert report.main([one, "--markdown", "-"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## ") and "| op | size | ranks |" in out and not (here / "-").exists(), out
    assert out.count("all_reduce") == 1  # the Markdown alone, not the text tables before it
    assert report.main([one, "--csv", "-"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("file,op,bytes,size,ranks") and len(lines) == 2, lines
