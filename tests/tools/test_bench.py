"""``mpistrat bench``: its sweep arithmetic, a run at this pass's size, and runs at 1-4 ranks.

A results file is validated against the conventions it claims (OSU-style iteration
counts, nccl-tests bandwidths) recomputed here from its own raw numbers.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat
from mpistrat.tools import (
    bench,
    bench_args,
    bench_case,
    bench_load,
    bench_meta,
    bench_optimizer,
    bench_progress,
    bench_report,
    host,
)
from mpistrat.tools.bench_ops import DEFAULT_OPS, OPS, Setup
from tests.conftest import all_ranks_agree
from tests.support.launch import launcher_options

WORLD = MPI.COMM_WORLD
OPTIMIZER_OPS = ["apply_gradients_sgd", "apply_gradients_adam"]
# the others check against their flat step run in float64, clipping by the global norm or not
KERAS_OPS = ["apply_gradients_adamw", "apply_gradients_rmsprop_clip", "apply_gradients_lamb_clip"]
SMALL = ["--max", "1KiB", "--iters", "3", "--min-iters", "2", "--leaves", "8"]


def test_sizes_are_powers_of_two_within_bounds():
    assert bench.sizes_between(4, 64) == [4, 8, 16, 32, 64]
    assert bench.sizes_between(5, 64) == [8, 16, 32, 64]
    assert bench.sizes_between(1, 1) == [1]
    assert len(bench.sizes_between(4, 64 << 20)) == 25


def test_iterations_shrink_with_size_as_osu_does():
    assert bench.iterations(8 << 10, 1000, 20) == (1000, 200)
    assert bench.iterations(16 << 10, 1000, 20) == (500, 100)
    assert bench.iterations(64 << 20, 1000, 20) == (20, 4)
    assert bench.iterations(4, 10, 20) == (10, 2)  # never more than asked for
    assert bench.iterations(4, 10, 20, warmup=0) == (10, 0)


def test_bad_arguments_are_refused_with_the_reason(capsys):
    for args, reason in (
        (["--ops", "all_reduce,nope"], "unknown ['nope']"),
        (["--dtype", "float16x"], "--dtype"),
        (["--dtype", "bool"], "--dtype"),
        (["--min", "1MiB", "--max", "4"], "larger than --max"),
        (["--leaves", "0"], "--leaves"),
        (["--compression", "bf16", "--deterministic"], "choose one"),
        (["--compression", "fp16", "--ops", "apply_gradients_adam"], "not with apply_gradients_adam"),
        (["--warmup", "-3"], "--warmup: expected an integer >= 0 (0: no warm-up); got -3"),
        (["--warmup=-5", "--iters", "2"], "--warmup: expected an integer >= 0"),
    ):
        with pytest.raises(SystemExit) as info:
            bench.main(args)
        assert info.value.code == 2
        assert reason in capsys.readouterr().err


def test_percentiles_are_nearest_rank():
    assert bench_report.percentile([7.0], 50) == 7.0 and bench_report.percentile([7.0], 99) == 7.0
    assert bench_report.percentile([4, 1, 3, 2], 50) == 2  # the 2nd of 4: half the values do not exceed it
    hundred = [float(v) for v in range(100, 0, -1)]  # 1..100, shuffled order does not matter
    assert bench_report.tail(hundred) == {"p50": 50.0, "p99": 99.0}
    assert bench_report.tail(hundred[:99]) == {"p50": 51.0, "p99": None}  # 2..100: 99 values, too few
    assert bench_report.tail([*[1.0] * 199, 1000.0]) == {"p50": 1.0, "p99": 1.0}  # one outlier in 200
    assert bench_report.tail([*[1.0] * 98, 1000.0, 1000.0]) == {"p50": 1.0, "p99": 1000.0}


def test_the_environment_leaves_out_other_variables_and_secrets():
    env = {
        "SLURM_JOB_ID": "42",
        "OMP_NUM_THREADS": "1",
        "UCX_TLS": "sm,self",
        "FI_PROVIDER": "tcp",
        "MPICH_ASYNC_PROGRESS": "0",
        "PMIX_RANK": "0",
        "NCCL_DEBUG": "INFO",
        "MPISTRAT_CHECK": "0",
        "OMPI_MCA_btl": "^ofi",
        "PATH": "/usr/bin",
        "HOME": "/root",
        "SLURM_API_TOKEN": "t",
        "MPISTRAT_SECRET": "s",
        "UCX_Password": "p",
        "FI_KEY_FILE": "k",
        "XSLURM_JOB_ID": "no",
    }
    assert bench_meta.environment(env) == {
        "FI_PROVIDER": "tcp",
        "MPICH_ASYNC_PROGRESS": "0",
        "MPISTRAT_CHECK": "0",
        "NCCL_DEBUG": "INFO",
        "OMPI_MCA_btl": "^ofi",
        "OMP_NUM_THREADS": "1",
        "PMIX_RANK": "0",
        "SLURM_JOB_ID": "42",
        "UCX_TLS": "sm,self",
    }


def test_cpu_lists_and_the_git_commit_of_a_checkout(tmp_path):
    assert bench_meta.cpu_list([5]) == "5" and bench_meta.cpu_list(range(64)) == "0-63"
    assert bench_meta.cpu_list([0, 2, 4, 5, 6]) == "0,2,4-6"
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "repo"
    (repo / ".git" / "refs" / "heads").mkdir(parents=True)
    (repo / "pkg" / "sub").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".git" / "refs" / "heads" / "main").write_text(sha + "\n")
    assert bench_meta.git_commit(repo / "pkg" / "sub") == sha
    (repo / ".git" / "refs" / "heads" / "main").unlink()  # packed, as after git gc
    (repo / ".git" / "packed-refs").write_text(f"# pack-refs with: peeled\n{sha} refs/heads/main\n")
    assert bench_meta.git_commit(repo / "pkg") == sha
    (repo / ".git" / "HEAD").write_text(sha[::-1] + "\n")  # detached
    assert bench_meta.git_commit(repo) == sha[::-1]
    assert bench_meta.git_commit(tmp_path / "elsewhere") is None or not (tmp_path / ".git").exists()


def test_an_unwritable_output_is_refused_before_the_sweep(tmp_path, capsys):
    blocker = tmp_path / f"file-{WORLD.Get_rank()}"
    blocker.write_text("")
    code = bench.main([*SMALL, "--json", str(blocker / "run.json"), "--no-progress"])
    out = capsys.readouterr()
    problems = [] if code == 2 else [f"exit code {code}"]
    if "## all_reduce" in out.out:
        problems.append("the sweep ran")
    if WORLD.Get_rank() == 0 and "cannot write it" not in out.err:
        problems.append(f"stderr {out.err[-300:]!r}")
    all_ranks_agree(WORLD, not problems, "; ".join(problems))


@pytest.mark.parametrize("where", ["a regular file", "/proc"])
def test_a_checkpoint_dir_that_cannot_hold_files_is_one_line_and_exit_2_on_every_rank(
    tmp_path, capsys, where
):
    bad = str(tmp_path / "a-file") if where == "a regular file" else "/proc/mpistrat-bench"
    if where == "a regular file":
        Path(bad).write_text("")
    code = bench.main(["--ops", "checkpoint", *SMALL, "--checkpoint-dir", bad, "--no-progress"])
    out = capsys.readouterr()
    problems = [] if code == 2 else [f"exit code {code}"]
    if "## checkpoint" in out.out or "Traceback" in out.err:
        problems.append("the sweep ran")
    lines = out.err.splitlines()
    said = f"--checkpoint-dir {bad}: cannot write checkpoints there"
    if WORLD.Get_rank() == 0 and not (len(lines) == 1 and said in lines[0]):
        problems.append(f"stderr {out.err[-300:]!r}")
    all_ranks_agree(WORLD, not problems, "; ".join(problems))


def test_a_max_between_powers_of_two_is_said(tmp_path, capsys):
    code = bench.main(["--ops", "all_reduce", "--min", "3", "--max", "3000", "--iters", "2", "--quiet"])
    err = capsys.readouterr().err
    problems = [] if code == 0 else [f"exit code {code}"]
    if WORLD.Get_rank() == 0 and not (
        "--max 3000 is not a power of two: the largest size is 2 KiB" in err
        and "--min 3 is not a power of two: the smallest size is 4 B" in err
    ):
        problems.append(f"stderr {err!r}")
    all_ranks_agree(WORLD, not problems, "; ".join(problems))


def crowded() -> bool:
    """Whether this job's ranks outnumber the logical cores they may use on some host, from each
    rank's host name and binding (raw mpi4py; collective)."""
    mine = (MPI.Get_processor_name(), sorted(os.sched_getaffinity(0)))
    hosts: dict[str, tuple[int, set[int]]] = {}
    for name, cpus in WORLD.allgather(mine):
        ranks, union = hosts.get(name, (0, set()))
        hosts[name] = (ranks + 1, union | set(cpus))
    return any(ranks > len(union) for ranks, union in hosts.values())


def validate(
    data: dict,
    ranks: int,
    ops: list[str] | None = None,
    max_bytes: int | None = None,
    oversubscribed: bool | None = None,
) -> list[str]:
    """Problems with a results file, [] if none. ``oversubscribed``: whether its rows must be marked so
    (default: a job started on this machine, unbound, is when it has more ranks than our cores)."""
    problems = []
    meta, rows = data["meta"], data["results"]
    if oversubscribed is None:
        oversubscribed = ranks > len(os.sched_getaffinity(0))
    if bool(meta.get("oversubscribed")) != oversubscribed or any(
        r.get("oversubscribed") is not oversubscribed for r in rows
    ):
        problems.append(f"oversubscribed: {meta.get('oversubscribed')}, rows not all {oversubscribed}")
    if data["format"] != bench_report.FORMAT:
        problems.append(f"format {data['format']}")
    for key in ("mpistrat", "mpi4py", "mpi_library", "hosts", "date", "options", "command", "check"):
        if key not in meta:
            problems.append(f"meta lacks {key}")
    env = meta.get("environment", {})
    if any(not k.startswith(bench_meta.PREFIXES) or "KEY" in k or "TOKEN" in k for k in env):
        problems.append(f"meta environment {sorted(env)}")
    if meta.get("cpu", {}).get("logical_cores") != os.cpu_count() or len(meta.get("affinity", [])) != ranks:
        problems.append(f"meta cpu {meta.get('cpu')} affinity {meta.get('affinity')}")
    start = meta.get("startup", {})  # each rank's start, process start to its first collective
    firsts = [r["points"]["first collective"] for r in start.get("ranks", [])]
    if (
        len(firsts) != ranks
        or None in firsts
        or start["summary"]["first collective"]["slowest"] != max(firsts)
    ):
        problems.append(f"meta startup {start.get('summary')}")
    if meta["ranks"] != ranks or meta["nodes"] != len(meta["hosts"]):
        problems.append(f"meta ranks/nodes {meta['ranks']}/{meta['nodes']}")
    seen = {r["op"] for r in rows}
    if ops is not None and seen != set(ops):
        problems.append(f"ops {sorted(seen)} != {sorted(ops)}")
    if len({(r["op"], r["bytes"]) for r in rows}) != len(rows):
        problems.append("a size repeats within an op")
    for r in rows:
        where = f"{r['op']} {r['bytes']} B"
        if r["ranks"] != ranks or (max_bytes and r["bytes"] > max_bytes and r["op"] != "all_reduce_nest"):
            problems.append(f"{where}: ranks {r['ranks']}")
        iters, warmup = bench.iterations(r["bytes"], *_iters(meta))
        if (r["iters"], r["warmup"]) != (iters, warmup):
            problems.append(f"{where}: iterations {r['iters']}/{r['warmup']}, expected {iters}/{warmup}")
        factor = OPS[r["op"]].busbw(ranks)
        for side in ("mpistrat", "raw", "raw2"):
            s = r[side]
            if s is None:
                continue
            t = s["time_us"]
            if not (s["ok"] and 0 < t["min"] <= t["avg"] * (1 + 1e-9) and t["avg"] <= t["max"] * (1 + 1e-9)):
                problems.append(f"{where} {side}: ok={s['ok']} times {t}")
            # p99 only from enough iterations; the slowest rank's iterations average at least the slowest mean
            enough = r["iters"] >= bench_report.P99_MIN_ITERS
            if not (
                t["p50"] > 0 and (t["p99"] is None) != enough and (t["p99"] is None or t["p99"] >= t["p50"])
            ):
                problems.append(f"{where} {side}: percentiles {t} after {r['iters']} iterations")
            algbw = r["bytes"] / (t["avg"] * 1e-6) / 1e9
            if not (
                math.isclose(s["algbw_GBps"], algbw, rel_tol=1e-6)
                and math.isclose(s["busbw_GBps"], algbw * factor, rel_tol=1e-6, abs_tol=1e-12)
            ):
                problems.append(f"{where} {side}: bandwidths {s['algbw_GBps']} {s['busbw_GBps']}")
        if not math.isclose(r["ratio"], r["mpistrat"]["time_us"]["avg"] / r["raw"]["time_us"]["avg"]):
            problems.append(f"{where}: ratio {r['ratio']}")
        if (r["raw2"] is None) != (OPS[r["op"]].raw2 is None):
            problems.append(f"{where}: raw2 {r['raw2']}")
    return problems


def _iters(meta: dict) -> tuple[int, int, int | None]:
    o = meta["options"]
    return o["iters"], o["min_iters"], o["warmup"]


def test_bench_at_this_size_writes_checked_json_and_csv(tmp_path, capsys):
    """At 3 or 4 ranks on 2 cores the run is oversubscribed: warned about, and every row marked."""
    n, rank = WORLD.Get_size(), WORLD.Get_rank()
    over = crowded()
    out = tmp_path / "run.json"
    code = bench.main([*SMALL, "--json", str(out), "--csv", str(tmp_path / "run.csv"), "--no-progress"])
    captured = capsys.readouterr()
    printed = captured.out
    problems = [f"exit code {code}"] if code else []
    if rank == 0:
        data = json.loads(out.read_text())
        problems += validate(data, n, DEFAULT_OPS, 1024, oversubscribed=over)
        if over != (bench_report.OVERSUBSCRIBED in captured.err):
            problems.append(f"oversubscribed {over}, stderr {captured.err[-300:]!r}")
        problems += [f"table lacks {op}" for op in DEFAULT_OPS if f"## {op}:" not in printed]
        csv_lines = (tmp_path / "run.csv").read_text().splitlines()
        if len(csv_lines) != 1 + len(data["results"]) or "time_avg_us" not in csv_lines[0]:
            problems.append(f"csv: {csv_lines[:2]}")
        if data["meta"]["shard"] is not False or data["meta"]["options"]["shard"] is not False:
            problems.append(f"shard recorded as {data['meta']['shard']}")
    elif printed:
        problems.append(f"rank {rank} printed {printed[:80]!r}")
    all_ranks_agree(WORLD, not problems, "; ".join(problems))


def _said(err: str) -> str:
    """stderr without the warnings a busy or crowded machine adds (tested on their own)."""
    return "".join(line for line in err.splitlines(True) if "WARNING: " not in line)


@pytest.mark.parametrize("tqdm", ["installed", "missing"])
def test_progress_is_tqdms_bar_and_without_tqdm_a_line_per_size(tmp_path, capsys, monkeypatch, tqdm):
    """tqdm is optional (the ``progress`` extra): without it ``--progress`` says so once and shows a
    line per size; the sweep and its files are the same."""
    if tqdm == "missing":
        monkeypatch.setitem(sys.modules, "tqdm", None)  # `from tqdm import tqdm` raises ImportError
    else:
        pytest.importorskip("tqdm")
    n, rank = WORLD.Get_size(), WORLD.Get_rank()
    over = crowded()
    out = tmp_path / "run.json"
    code = bench.main([*SMALL, "--json", str(out), "--csv", str(tmp_path / "run.csv"), "--progress"])
    printed = capsys.readouterr()
    err = _said(printed.err)
    problems = [f"exit code {code}"] if code else []
    if rank == 0:
        data = json.loads(out.read_text())
        problems += validate(data, n, DEFAULT_OPS, 1024, oversubscribed=over)
        problems += [f"table lacks {op}" for op in DEFAULT_OPS if f"## {op}:" not in printed.out]
        csv_lines = (tmp_path / "run.csv").read_text().splitlines()
        if len(csv_lines) != 1 + len(data["results"]) or "time_avg_us" not in csv_lines[0]:
            problems.append(f"csv: {csv_lines[:2]}")
        tasks = len(DEFAULT_OPS) * len(bench.sizes_between(4, 1024))
        if tqdm == "installed" and (f"{tasks}/{tasks}" not in err or "sizes measured" in err):
            problems.append(f"no finished bar in stderr {err[-300:]!r}")
        said = "mpistrat bench: --progress: tqdm is not installed (pip install tqdm, or the progress extra)"
        lines = err.splitlines()
        if tqdm == "missing" and not (
            lines[0].startswith(said)
            and lines[-1].startswith(f"mpistrat bench: {tasks}/{tasks} sizes measured")
        ):
            problems.append(f"stderr {err[-300:]!r}")
    elif printed.out or err:
        problems.append(f"rank {rank} printed {printed.out[:80]!r} {err[:80]!r}")
    all_ranks_agree(WORLD, not problems, "; ".join(problems))


def test_without_a_terminal_progress_is_a_line_per_size_and_the_table_comes_row_by_row(
    tmp_path, capsys, monkeypatch
):
    """In a batch log (no terminal) rank 0 prints no bar: a line per size on stderr, and each row of
    the table on stdout once measured, between the lines of the sizes before and after it."""
    monkeypatch.setattr(bench_progress, "from_terminal", lambda: False)
    events: list[tuple[str, str]] = []  # (stream, line), in the order they were written

    class Tap:
        def __init__(self, name, real):
            self.name, self.real = name, real

        def write(self, text):
            events.extend((self.name, line) for line in text.splitlines() if line)
            return self.real.write(text)

        def flush(self):
            self.real.flush()

    monkeypatch.setattr(sys, "stdout", Tap("out", sys.stdout))
    monkeypatch.setattr(sys, "stderr", Tap("err", sys.stderr))
    code = bench.main(
        ["--ops", "all_reduce", "--min", "4", "--max", "16", "--iters", "3", "--min-iters", "2"]
    )
    capsys.readouterr()
    problems = [f"exit code {code}"] if code else []
    if WORLD.Get_rank() == 0:
        sizes = {"4 B", "8 B", "16 B"}
        seen = [
            line[:9].strip() if stream == "out" else line.split("),")[0] + ")"
            for stream, line in events
            if (stream == "out" and line[:9].strip() in sizes) or "sizes measured" in line
        ]
        want = [
            "4 B",
            "mpistrat bench: 1/3 sizes measured (all_reduce 4 B)",
            "8 B",
            "mpistrat bench: 2/3 sizes measured (all_reduce 8 B)",
            "16 B",
            "mpistrat bench: 3/3 sizes measured (all_reduce 16 B)",
        ]
        if seen != want:
            problems.append(f"order {seen}")
        if any("\r" in line for _, line in events):
            problems.append("a carriage return: a redrawn bar")
    elif events:
        problems.append(f"rank {WORLD.Get_rank()} printed {events[:2]}")
    all_ranks_agree(WORLD, not problems, "; ".join(problems))


def test_bench_without_check_other_dtype_and_train_step(tmp_path):
    n, rank = WORLD.Get_size(), WORLD.Get_rank()
    over = crowded()  # collective: every rank
    out = tmp_path / "run.json"
    args = ["--ops", "all_reduce,train_step,run_step", "--dtype", "int32", "--no-check", "--min", "512"]
    code = bench.main([*SMALL, *args, "--scaling", "strong", "--batch", "8", "--json", str(out), "--quiet"])
    problems = [f"exit code {code}"] if code else []
    if rank == 0:
        data = json.loads(out.read_text())
        problems += validate(data, n, ["all_reduce", "train_step", "run_step"], oversubscribed=over)
        meta = data["meta"]
        if meta["check"] or meta["scaling"] != "strong" or meta["options"]["dtype"] != "int32":
            problems.append(f"meta {meta['check']} {meta['scaling']} {meta['options']}")
    all_ranks_agree(WORLD, not problems, "; ".join(problems))


@pytest.mark.parametrize("op", OPTIMIZER_OPS + KERAS_OPS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])  # int32: float32 weights
def test_optimizer_step_checks_weights_after_however_many_steps(group, op, dtype):
    """Each side's check holds after every step, and only at the step count the side reports."""
    setup = Setup(group.strategy, group.comm, np.dtype(dtype), 1000, 3, 1, "weak")
    case = OPS[op].build(setup)
    problems = []
    if (case.count, case.leaves, case.nbytes) != (1000 // np.dtype(dtype).itemsize, 3, 1000):
        problems.append(f"case {case.count} {case.leaves} {case.nbytes}")
    for name, (fn, check) in case.variants.items():
        for _ in range(4):
            k = fn()
            if not check(k):
                problems.append(f"{name}: check fails after step {k}")
        if check(k - 1) or check(k + 1):  # the weights after k steps are not those after k -/+ 1
            problems.append(f"{name}: the check cannot tell step {k} from its neighbours")
    all_ranks_agree(group.comm, not problems, "; ".join(problems))


@pytest.mark.parametrize("rule", sorted(bench_optimizer.RULES))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_flat_update_is_the_per_variable_update_over_the_whole_arrays(rule, dtype):
    """raw2's in-place passes over flat arrays give raw's per-variable update, step after step."""
    r = bench_optimizer.RULES[rule]
    rng = np.random.default_rng(1)
    sizes = [3, 10, 1, 7]
    w = rng.standard_normal(sum(sizes)).astype(dtype)
    slots = [np.zeros_like(w) for _ in range(r.slots)]
    leaves = np.split(w.copy(), np.cumsum(sizes)[:-1])  # raw's K variables, stepped one at a time
    leaf_slots = [[np.zeros_like(leaf) for _ in range(r.slots)] for leaf in leaves]
    for step in range(5):
        g = rng.standard_normal(w.size).astype(dtype)
        parts = np.split(g.copy(), np.cumsum(sizes)[:-1])  # each side may overwrite its gradient
        for leaf, part, slot in zip(leaves, parts, leaf_slots, strict=True):
            r.update(step, leaf, part, slot)
        r.flat(step, w, g.copy(), slots, np.empty_like(w), np.cumsum([0, *sizes[:-1]]))
        tol = 50 * np.finfo(dtype).eps
        np.testing.assert_allclose(w, np.concatenate(leaves), rtol=tol, atol=tol)
        for i in range(r.slots):
            np.testing.assert_allclose(
                slots[i], np.concatenate([s[i] for s in leaf_slots]), rtol=tol, atol=tol
            )


@pytest.mark.parametrize("op", OPTIMIZER_OPS)
def test_optimizer_ops_time_the_flat_step_as_raw2(group, op):
    """raw2, the weights and each slot one flat array, is a third side checked like the others."""
    setup = Setup(group.strategy, group.comm, np.dtype("float32"), 4000, 7, 1, "weak")
    case = OPS[op].build(setup)
    assert OPS[op].raw2 and list(case.variants) == ["mpistrat", "raw", "raw2"]  # the same on every rank
    fn, check = case.variants["raw2"]
    problems = []
    for _ in range(5):
        k = fn()
        if not check(k) or check(k + 1):
            problems.append(f"raw2: check after step {k}")
    all_ranks_agree(group.comm, not problems, "; ".join(problems))


def test_shard_builds_the_optimizers_with_shard_state_and_is_recorded(tmp_path, capsys, monkeypatch):
    n, rank = WORLD.Get_size(), WORLD.Get_rank()
    over = crowded()  # collective: every rank
    made: list[dict] = []
    for name in ("SGD", "Adam"):
        real = getattr(mpistrat.optimizers, name)

        def spy(*args, real=real, **kwargs):
            made.append(dict(kwargs))
            return real(*args, **kwargs)

        monkeypatch.setattr(mpistrat.optimizers, name, spy)
    out, csv_out = tmp_path / "run.json", tmp_path / "run.csv"
    ops = [*OPTIMIZER_OPS, "all_reduce"]
    args = ["--ops", ",".join(ops), "--min", "512", "--shard", "--no-progress"]
    code = bench.main([*SMALL, *args, "--json", str(out), "--csv", str(csv_out)])
    printed = capsys.readouterr().out
    problems = [f"exit code {code}"] if code else []
    if not made or any(kw.get("shard_state") is not True for kw in made):
        problems.append(f"optimizers made with {made}")
    if rank == 0:
        data = json.loads(out.read_text())
        problems += validate(data, n, ops, 1024, oversubscribed=over)
        if data["meta"]["shard"] is not True or data["meta"]["options"]["shard"] is not True:
            problems.append(f"meta {data['meta']}")
        if "optimizer state sharded" not in printed.splitlines()[0]:
            problems.append(f"table header {printed.splitlines()[:1]}")
        header, *rows = [line.split(",") for line in csv_out.read_text().splitlines()]
        if len(rows) != len(data["results"]) or any(row[header.index("shard")] != "True" for row in rows):
            problems.append(f"csv {header} {rows[:1]}")
    all_ranks_agree(WORLD, not problems, "; ".join(problems))


def test_optimizer_steps_through_the_cli_without_warm_up(tmp_path):
    n, rank = WORLD.Get_size(), WORLD.Get_rank()
    over = crowded()  # collective: every rank
    out = tmp_path / "run.json"
    args = ["--ops", ",".join(OPTIMIZER_OPS), "--dtype", "float64", "--warmup", "0", "--min", "256"]
    code = bench.main([*SMALL, *args, "--json", str(out), "--quiet"])
    problems = [f"exit code {code}"] if code else []
    if rank == 0:
        data = json.loads(out.read_text())
        problems += validate(data, n, OPTIMIZER_OPS, 1024, oversubscribed=over)
        problems += [
            f"{r['op']}: count {r['count']}" for r in data["results"] if r["count"] * 8 != r["bytes"]
        ]
    all_ranks_agree(WORLD, not problems, "; ".join(problems))


def mpiexec_env() -> dict[str, str]:
    """This environment without the launcher's variables, so a child mpiexec starts afresh."""
    prefixes = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "OMPI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else root
    return env


def mpiexec() -> list[str]:
    """The launcher and what this MPI family needs to start a test job here (tests/support/launch.py)."""
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec next to this Python or on PATH")
    return [found, *launcher_options()]


@pytest.mark.serial
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_bench_under_mpiexec(tmp_path, ranks):
    out = tmp_path / f"bench-{ranks}.json"
    args = [*SMALL, "--json", str(out)]
    cmd = [*mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpistrat", "bench", *args]
    done = subprocess.run(cmd, env=mpiexec_env(), capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("## all_reduce:") == 1, done.stdout[-2000:]  # the table, from rank 0 only
    assert validate(json.loads(out.read_text()), ranks, DEFAULT_OPS, 1024) == []


@pytest.mark.serial
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_optimizer_steps_under_mpiexec(tmp_path, ranks):
    out = tmp_path / f"bench-{ranks}.json"
    args = [*SMALL, "--ops", ",".join(OPTIMIZER_OPS), "--json", str(out)]
    cmd = [*mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpistrat", "bench", *args]
    done = subprocess.run(cmd, env=mpiexec_env(), capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(done.stdout.count(f"## {op}:") == 1 for op in OPTIMIZER_OPS), done.stdout[-2000:]
    assert validate(json.loads(out.read_text()), ranks, OPTIMIZER_OPS, 1024) == []


def _rank_pid(marker: str, rank: int) -> int | None:
    """The process of ``rank`` in a job whose command line holds ``marker`` (MPICH's Hydra and Open
    MPI set PMI_RANK / OMPI_COMM_WORLD_RANK), or None while it has not started."""
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if marker.encode() not in cmdline or b"mpiexec" in cmdline or b"prterun" in cmdline:
                continue
            env = dict(v.split(b"=", 1) for v in (entry / "environ").read_bytes().split(b"\0") if b"=" in v)
        except (OSError, ValueError):
            continue
        if env.get(b"PMI_RANK", env.get(b"OMPI_COMM_WORLD_RANK")) == str(rank).encode():
            return int(entry.name)
    return None


def _files_as_read(json_path: Path, csv_path: Path, rows: int, limit: float) -> tuple[dict, list[dict]]:
    """Read both files every 50 ms, as another program would while the sweep writes them, until the
    JSON holds ``rows`` rows: each read must parse whole (a cut or half-written file would not)."""
    import csv

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if json_path.exists() and csv_path.exists():
            data = json.loads(json_path.read_text())  # raises on a partial file
            table = list(csv.DictReader(csv_path.open()))
            assert [(r["op"], int(r["bytes"])) for r in table] == [
                (r["op"], r["bytes"]) for r in data["results"][: len(table)]
            ], (table, data["results"])
            if len(data["results"]) >= rows:
                return data, table
        time.sleep(0.05)
    pytest.fail(f"no {rows} rows in {json_path} after {limit} s")


@pytest.mark.serial
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds a rank's process in /proc")
@pytest.mark.parametrize("how", ["SIGTERM to rank 1", "SIGKILL"])
def test_a_cut_sweep_leaves_valid_files_of_its_finished_rows(tmp_path, how):
    """Every row goes to the JSON and the CSV as it is measured, each rewritten and renamed into place,
    so a job killed at any moment leaves valid files; SIGTERM on any one rank (Slurm's time limit)
    ends the sweep on every rank after the size it is in, with the files marked partial (exit 75)."""
    import csv

    json_path, csv_path = tmp_path / "run.json", tmp_path / "run.csv"
    ranks = 3 if how.startswith("SIGTERM") else 2  # 3: the signal reaches one rank of an uneven job
    args = ["--ops", "all_reduce", "--min", "4", "--max", "64MiB", "--iters", "300", "--min-iters", "300"]
    cmd = [*mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpistrat", "bench", *args]
    cmd += ["--json", str(json_path), "--csv", str(csv_path), "--no-progress"]
    with subprocess.Popen(
        cmd,
        env=mpiexec_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            before, _ = _files_as_read(json_path, csv_path, 2, limit=90)
            assert before["meta"]["partial"].startswith("the sweep did not finish"), before["meta"]
            if how == "SIGKILL":
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                pid = _rank_pid(str(json_path), 1)
                assert pid is not None, "rank 1's process not found"
                os.kill(pid, signal.SIGTERM)
            out, err = proc.communicate(timeout=90)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    data = json.loads(json_path.read_text())
    table = list(csv.DictReader(csv_path.open()))
    rows = data["results"]
    assert validate(data, ranks, ["all_reduce"]) == []
    assert len(rows) >= 2 and rows[0]["bytes"] == 4 and rows[-1]["bytes"] < 64 << 20, rows
    assert [int(r["bytes"]) for r in table] == [r["bytes"] for r in rows][: len(table)]
    if how == "SIGKILL":  # the last row may have reached the JSON alone
        assert len(rows) - 1 <= len(table) <= len(rows)
        assert data["meta"]["partial"].startswith("the sweep did not finish"), data["meta"]
        return
    assert proc.returncode == bench.STOPPED, err[-2000:]
    assert len(table) == len(rows) and {r["partial"] for r in table} == {data["meta"]["partial"]}
    assert data["meta"]["partial"].startswith(f"stopped by SIGTERM after {len(rows)} of its 25 sizes"), data
    assert "# WARNING: partial results: stopped by SIGTERM" in out, out[-2000:]
    assert out.count("\n    ") >= len(rows) and out.count(" yes") == len(rows), out  # the rows, printed
    assert data["meta"]["load"][0]["seconds"] > 0, data["meta"]["load"]  # read again at the stop


@pytest.mark.serial
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins processes to a core (Linux)")
def test_a_busy_loop_beside_the_bench_is_warned_about_and_reported(tmp_path):
    """The rank and four busy loops share CPU 0: the rank gets a fifth of it, the loops the rest, and
    bench says the host was busy (others kept about 0.8 of the rank's one core busy, none left free),
    under its table and in the JSON, which ``report`` then repeats."""
    # each loop says it is pinned and spinning before the bench starts: the sweep is short, and a
    # loop still starting Python (slow beside other tests) would leave the rank its core
    code = "import os, sys; os.sched_setaffinity(0, {0}); sys.stdout.write('x'); sys.stdout.flush()\n"
    code += "while True: pass"
    # each loop in a session of its own: where the kernel shares a core between sessions first
    # (autogroup), loops in one session would take the rank's session's share together, about half
    busy = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
        for _ in range(4)
    ]
    try:
        for p in busy:
            assert p.stdout is not None and p.stdout.read(1) == b"x"
        out = tmp_path / "run.json"
        args = ["--ops", "all_reduce", "--max", "64", "--iters", "1500", "--json", str(out), "--no-progress"]
        cmd = ["taskset", "-c", "0", *mpiexec(), "-n", "1", sys.executable, "-m", "mpistrat", "bench", *args]
        if shutil.which("taskset") is None:
            pytest.skip("needs taskset (util-linux)")
        done = subprocess.run(cmd, env=mpiexec_env(), capture_output=True, text=True, timeout=120)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    load = json.loads(out.read_text())["meta"]["load"]
    assert len(load) == 1 and load[0]["cores"] == 1 and load[0]["ranks"] == 1, load
    assert load[0]["others_cores"] > 0.5, load  # four loops against one rank: about 0.8
    said = f"other processes kept {load[0]['others_cores']:g} of the ranks' 1 cores busy during the sweep"
    assert f"# WARNING: {load[0]['host']} was busy: " in done.stdout and said in done.stdout, done.stdout[
        -2000:
    ]
    report = subprocess.run(
        [sys.executable, "-m", "mpistrat", "report", str(out)],
        env=mpiexec_env(),
        capture_output=True,
        text=True,
    )
    assert report.returncode == 0 and said in report.stdout, report.stdout + report.stderr


@pytest.mark.serial
@pytest.mark.parametrize("mode", [["--deterministic"], ["--compression", "bf16"], ["--compression", "fp16"]])
def test_bench_times_exact_and_compressed_reductions_and_records_the_mode(tmp_path, mode):
    """The reduce ops' results are checked: exact for --deterministic (the pattern's sums are exact),
    within the stated 16-bit bound for --compression; the mode is in the JSON's options."""
    out = tmp_path / "bench.json"
    ops = "all_reduce,all_reduce_nest,reduce,run_step,merge_call"
    args = [*SMALL, "--ops", ops, "--json", str(out), *mode]
    cmd = [*mpiexec(), "-n", "3", sys.executable, "-m", "mpistrat", "bench", *args]
    done = subprocess.run(cmd, env=mpiexec_env(), capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert validate(result, 3, ops.split(","), 1024) == []
    recorded = result["meta"]["options"]
    assert recorded["deterministic"] is ("--deterministic" in mode)
    assert recorded["compression"] == (mode[1] if len(mode) > 1 else None)
    assert all(row["mpistrat"]["ok"] for row in result["results"])


def test_the_compression_tolerance_is_the_documented_bound():
    """(2u + (R+1) 2^-24)(1 + u), with u = 2^-8 for bf16 and 2^-11 for fp16 (docs/concepts.md)."""
    args = bench_args.parser().parse_args(["--compression", "bf16"])
    assert bench_args.tolerance(args, 4) == (2 * 2**-8 + 5 * 2**-24) * (1 + 2**-8)
    args = bench_args.parser().parse_args(["--compression", "fp16"])
    assert bench_args.tolerance(args, 2) == (2 * 2**-11 + 3 * 2**-24) * (1 + 2**-11)
    assert bench_args.tolerance(bench_args.parser().parse_args([]), 2) == 0.0


@pytest.mark.parametrize("shard", [[], ["--shard"]], ids=["replicated", "sharded"])
def test_checkpoint_ops_save_and_restore_a_model_with_adam_beside_raw_mpi_io(tmp_path, shard):
    """``--ops checkpoint`` is both checkpoint ops; a row's size is the file's (the parameters and
    Adam's two slots, and a header); the files go to --checkpoint-dir and are removed after."""
    n, rank = WORLD.Get_size(), WORLD.Get_rank()
    over = crowded()  # collective: every rank
    out = tmp_path / "run.json"
    folder = WORLD.bcast(str(tmp_path / "files"), root=0)
    args = ["--ops", "checkpoint", "--min", "64K", "--max", "128K", "--leaves", "4", "--iters", "2"]
    code = bench.main(
        [*args, "--min-iters", "2", "--checkpoint-dir", folder, *shard, "--json", str(out), "--quiet"]
    )
    problems = [f"exit code {code}"] if code else []
    if rank == 0:
        data = json.loads(out.read_text())
        problems += validate(data, n, ["checkpoint_save", "checkpoint_restore"], oversubscribed=over)
        rows = {(r["op"], r["count"]): r["bytes"] for r in data["results"]}
        for params in (16384, 32768):  # float32 parameters at 64 KiB and 128 KiB
            for op in ("checkpoint_save", "checkpoint_restore"):
                size = rows.get((op, params), 0)
                if not 3 * 4 * params < size < 3 * 4 * params + (16 << 10):
                    problems.append(f"{op} of {params} parameters: {size} bytes")
        if os.listdir(folder):
            problems.append(f"left behind: {os.listdir(folder)}")
    all_ranks_agree(WORLD, not problems, "; ".join(problems))


def test_a_cases_settle_runs_after_each_variant_outside_its_time(monkeypatch):
    """What one side leaves pending (the checkpoint ops: a flush of the file systems) is settled
    after each call, every side alike, and no side's time holds it (a clock the settle moves by 100 s)."""
    clock, calls = [0.0], []

    def variant(name):
        def call():
            calls.append(name)
            clock[0] += 1.0

        return call

    def settle():
        calls.append("settle")
        clock[0] += 100.0

    monkeypatch.setattr(bench.MPI, "Wtime", lambda: clock[0])
    variants = {name: (variant(name), lambda _: True) for name in ("mpistrat", "raw")}
    case = bench_case.Case(8, 2, 1, variants, settle=settle)
    timed = bench._measure(MPI.COMM_SELF, case, iters=3, warmup=1)
    assert calls == ["mpistrat", "settle", "raw", "settle", "raw", "settle", "mpistrat", "settle"] * 2
    assert {name: times.tolist() for name, (times, _) in timed.items()} == {
        "mpistrat": [1.0] * 3,
        "raw": [1.0] * 3,
    }


def test_a_largest_size_that_does_not_fit_in_memory_is_refused_before_the_sweep(capsys):
    """1 TiB per buffer: refused on every rank (exit 2) with the size that fits, nothing allocated."""
    code = bench.main(["--min", "1024G", "--max", "1024G", "--no-progress"])
    out = capsys.readouterr()
    problems = [] if code == 2 else [f"exit code {code}"]
    if "##" in out.out:
        problems.append("the sweep ran")
    if WORLD.Get_rank() == 0 and not (
        "--max 1024 GiB:" in out.err and "the largest size that fits" in out.err
    ):
        problems.append(f"stderr {out.err[-400:]!r}")
    all_ranks_agree(WORLD, not problems, "; ".join(problems))


def test_the_memory_check_weighs_every_rank_on_the_host():
    """all_reduce holds 6 times its size per rank (measured: benchmarks/bench_footprint.py): 1 MiB at
    2 ranks on a host with 10 MiB is 12 MiB, too much; 512 KiB (6 MiB) fits."""
    two = host.HostLoad("h", ranks=2, cores=8)
    said = bench_args.memory_problem(["all_reduce"], 1 << 20, 2, two, 10 << 20)
    assert said and "the largest size that fits is about 512 KiB" in said and "2 rank(s) on h" in said
    assert bench_args.memory_problem(["all_reduce"], 512 << 10, 2, two, 10 << 20) is None
    assert bench_args.memory_problem(["all_reduce"], 1 << 40, 2, two, None) is None  # not known: no check
    # merge_call's root gathers every rank's: 6 + R times the size
    assert OPS["merge_call"].bytes_needed(1 << 20, 4) == 10 << 20


def test_memory_available_reads_meminfo_and_a_smaller_cgroup_limit(tmp_path):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    assert host.memory_available(tmp_path) == 4000000 * 1024
    (tmp_path / "proc/self/cgroup").write_text("0::/job_7/step_0\n")
    group = tmp_path / "sys/fs/cgroup/job_7/step_0"
    group.mkdir(parents=True)
    (group / "memory.max").write_text("max\n")  # no limit: MemAvailable
    assert host.memory_available(tmp_path) == 4000000 * 1024
    (group / "memory.max").write_text(f"{3 << 30}\n")
    (group / "memory.current").write_text(f"{1 << 30}\n")
    assert host.memory_available(tmp_path) == 2 << 30


def test_a_host_load_counts_ranks_against_the_union_of_their_bindings():
    assert host.loads([("a", [0], 2), ("a", [0], 2), ("a", [1], 2)]) == [host.HostLoad("a", 3, 2)]
    unbound = host.loads([("b", None, 4)] * 4 + [("c", None, 4)] * 5)
    assert [(h.host, h.oversubscribed) for h in unbound] == [("b", False), ("c", True)]


def test_the_cores_others_kept_busy_come_from_proc_stat_and_the_ranks_own_cpu_time(tmp_path):
    """/proc/stat's lines of the ranks' cores only; busy = all - idle - iowait - steal; what the
    ranks did not use of it, per second, is the others'; warned about beyond the free cores + SLACK."""
    stat = tmp_path / "proc/stat"
    stat.parent.mkdir(parents=True)
    # cpu user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(
        "cpu  900 0 100 1000 0 0 0 0 0 0\n"
        "cpu0 300 0 0 100 50 0 0 10 7 0\n"
        "cpu1 400 0 0 200 0 0 0 0 0 0\n"
        "cpu2 5 0 0 999 0 0 0 0 0 0\n"
        "intr 1 2 3\n"
    )
    assert bench_load.ticks([0, 1], tmp_path) == bench_load.Ticks(total=1060, idle=350, steal=10)
    assert bench_load.ticks(None, tmp_path) == bench_load.Ticks(total=2064, idle=1349, steal=10)
    assert bench_load.ticks([0], tmp_path / "elsewhere") is None
    # 2 cores for 4 s: 800 ticks; 700 of them busy (7 s), 40 stolen; the ranks used 3 s: others 4 s / 4 s
    start = bench_load.Reading(10.0, 1.0, [0.5, 0.5, 0.5], bench_load.Ticks(1000, 300, 0), 8)
    end = bench_load.Reading(14.0, 4.0, [3.0, 1.0, 0.5], bench_load.Ticks(1800, 360, 40), 8)
    assert bench_load.assess(start, end, cores=2, hz=100) == {
        "seconds": 4.0,
        "others_cores": 1.0,
        "steal": 0.05,
    }
    entry = {"host": "n1", "ranks": 2, "cores": 2, "logical_cores": 8, "loadavg_before": [0.5, 0.5, 0.5]}
    assert bench_load.warnings([{**entry, "others_cores": 0.5}]) == []  # 0 free + SLACK
    (warned,) = bench_load.warnings([{**entry, "others_cores": 0.51, "steal": 0.05}])
    assert warned.startswith(
        "n1 was busy: other processes kept 0.51 of the ranks' 2 cores busy during the sweep"
    )
    assert "the hypervisor took 5% of the cores' time" in warned
    # the load average before: against the machine's 8 logical cores less the 2 ranks
    assert bench_load.warnings([{**entry, "loadavg_before": [6.5, 1, 1]}]) == []
    (warned,) = bench_load.warnings([{**entry, "loadavg_before": [6.6, 1, 1]}])
    assert "the load average was 6.6 before the sweep, with 6 of its 8 logical cores left free" in warned


def test_optimizer_rows_of_ranks_sharing_a_host_without_a_thread_variable_are_warned_about():
    step, sum_ = {"op": "apply_gradients_lamb", "bytes": 4}, {"op": "all_reduce", "bytes": 4}
    shared = {"ranks": 2, "nodes": 1, "threads": {}}
    assert bench_report.warnings(shared, [sum_, step]) == [bench_report.THREADS_UNSET]
    assert bench_report.warnings({**shared, "threads": {"OMP_NUM_THREADS": "1"}}, [step]) == []
    assert bench_report.warnings(shared, [sum_]) == []  # no BLAS in the step
    assert bench_report.warnings({**shared, "ranks": 2, "nodes": 2}, [step]) == []  # a rank per host
    assert bench_report.warnings({"ranks": 2, "nodes": 1}, [step]) == []  # an older file: unknown


def test_rows_whose_mean_is_over_twice_their_median_are_marked_and_warned_about():
    def row(avg, p50, raw_avg=10.0, raw_p50=10.0):
        side = lambda a, p: {"time_us": {"avg": a, "p50": p, "min": a, "max": a}}  # noqa: E731
        return {"op": "all_reduce", "bytes": 4, "mpistrat": side(avg, p50), "raw": side(raw_avg, raw_p50)}

    assert bench_report.skewed(row(20.0, 10.0)) == []  # twice: not more than twice
    assert bench_report.skewed(row(1476.0, 320.0)) == ["mpistrat"]
    assert bench_report.skewed(row(5.0, 5.0, raw_avg=30.0)) == ["raw"]
    assert (
        bench_report.skewed({"mpistrat": {"time_us": {"avg": 9.0}}, "raw": None}) == []
    )  # no p50: older file
    (said,) = bench_report.warnings({}, [row(1476.0, 320.0), row(5.0, 5.0)])
    assert said.startswith("1 row(s) marked 'skewed' have a mean more than 2x their median (p50) ")
    assert "(all_reduce 4 B: mean 1476.00 us, p50 320.00)" in said
