"""``mpistrat plot``: figures from results files, and the scaling arithmetic it draws."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from mpi4py import MPI

from mpistrat.tools import bench_report, plot
from tests.tools.test_bench import SMALL, mpiexec, mpiexec_env

pytestmark = pytest.mark.serial("files in, a picture out: nothing here depends on the number of ranks")

PNG = b"\x89PNG\r\n\x1a\n"
pytest.importorskip("matplotlib")


def test_speedup_and_efficiency_follow_their_definitions():
    # strong: same total work; ideal time halves with twice the ranks
    speedup, efficiency = plot.speedup_efficiency("strong", [2, 4, 8], [10.0, 5.0, 4.0])
    assert speedup == [1.0, 2.0, 2.5] and efficiency == [1.0, 1.0, 2.5 * 2 / 8]
    # weak: same work per rank; ideal time stays constant
    speedup, efficiency = plot.speedup_efficiency("weak", [1, 4], [3.0, 6.0])
    assert speedup == [1.0, 2.0] and efficiency == [1.0, 0.5]


def _fake_run(ranks: int, scaling: str, scale: float) -> dict:
    """A results file as bench writes it, with made-up times (the plot must not care)."""
    rows = []
    for op in ("all_reduce", "train_step", "all_reduce_nest", "apply_gradients_adam"):
        for nbytes in (256, 1024, 4096):
            t = scale * (1 + nbytes / 1024) * (1 + ranks / 4)

            def side(time_us, nbytes=nbytes):
                algbw = nbytes / (time_us * 1e-6) / 1e9
                return {
                    "time_us": {"min": time_us, "avg": time_us, "max": time_us},
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw,
                    "ok": True,
                }

            two = op == "all_reduce_nest"
            rows.append(
                {
                    "op": op,
                    "bytes": nbytes,
                    "count": nbytes // 4,
                    "leaves": 8 if two else 1,
                    "dtype": "float32",
                    "ranks": ranks,
                    "iters": 5,
                    "warmup": 1,
                    "mpistrat": side(t * 1.1),
                    "raw": side(t),
                    "raw2": side(t / 2) if two else None,
                    "ratio": 1.1,
                    "ratio2": 2.2 if two else None,
                }
            )
    meta = {"label": f"{ranks} ranks", "ranks": ranks, "nodes": 1, "hosts": ["h"], "scaling": scaling}
    return {"format": bench_report.FORMAT, "meta": meta, "results": rows}


@pytest.fixture
def runs(tmp_path):
    paths = []
    for scaling, ranks in (("strong", 1), ("strong", 2), ("strong", 4), ("weak", 1), ("weak", 2)):
        path = tmp_path / f"{scaling}-{ranks}.json"
        path.write_text(json.dumps(_fake_run(ranks, scaling, 10.0)))
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("kind", ["bandwidth", "ratio", "scaling", "auto"])
def test_each_kind_writes_a_png(runs, tmp_path, kind, capsys):
    out = tmp_path / f"{kind}-{MPI.COMM_WORLD.Get_rank()}.png"
    assert plot.main([*runs, "-o", str(out), "--kind", kind]) == 0
    assert out.read_bytes()[:8] == PNG
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("op", ["all_reduce", "apply_gradients_adam"])
def test_scaling_of_a_chosen_op_and_size(runs, tmp_path, op):
    out = tmp_path / f"s-{MPI.COMM_WORLD.Get_rank()}.png"
    assert plot.main([*runs, "-o", str(out), "--kind", "scaling", "--op", op, "--size", "1KiB"]) == 0
    assert out.read_bytes()[:8] == PNG


def test_bad_inputs_are_reported_not_raised(runs, tmp_path, capsys):
    not_results = tmp_path / "other.json"
    not_results.write_text('{"hello": 1}')
    out = str(tmp_path / "x.png")
    assert plot.main([str(not_results), "-o", out]) == 2
    assert "not a results file of mpistrat bench" in capsys.readouterr().err
    assert plot.main([*runs, "-o", out, "--ops", "nope"]) == 2
    assert "--ops" in capsys.readouterr().err
    assert plot.main([*runs, "-o", out, "--kind", "scaling", "--op", "merge_call"]) == 2
    assert "not in every results file" in capsys.readouterr().err
    assert plot.main([*runs, "-o", out, "--kind", "scaling", "--op", "all_reduce", "--size", "2MiB"]) == 2
    assert "no all_reduce result" in capsys.readouterr().err


def test_an_output_that_is_not_an_image_is_refused_before_drawing(runs, tmp_path, capsys):
    for name in ("x.txt", "noextension"):
        assert plot.main([*runs, "-o", str(tmp_path / name), "--kind", "bandwidth"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mpistrat plot: -o ") and ".png, .svg or .pdf" in err and "Traceback" not in err
        named = re.findall(r"\.(\w+)", err.split("name an image:")[1])
        assert sorted(named) == sorted(plot.FORMATS), named  # each format once
        assert not (tmp_path / name).exists()
    assert plot.main([*runs, "-o", str(tmp_path / "missing-dir" / "x.png"), "--kind", "bandwidth"]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_kind_has_help_text():
    text = " ".join(plot._parser().format_help().split())
    assert "auto (default)" in text and "several rank counts" in text


@pytest.mark.serial
def test_plot_of_real_runs_at_several_rank_counts(tmp_path):
    paths = []
    for ranks in (1, 2):
        path = tmp_path / f"bench-{ranks}.json"
        ops = ["--ops", "all_reduce,all_gather_uneven,train_step,apply_gradients_sgd", "--batch", "4"]
        cmd = [*mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpistrat", "bench", *SMALL, *ops]
        done = subprocess.run(
            [*cmd, "--json", str(path), "--quiet"], env=mpiexec_env(), capture_output=True, timeout=110
        )
        assert done.returncode == 0, done.stderr[-3000:]
        paths.append(str(path))
    for kind in ("bandwidth", "ratio", "scaling"):
        out = tmp_path / f"{kind}.png"
        cmd = [sys.executable, "-m", "mpistrat", "plot", *paths, "-o", str(out), "--kind", kind]
        done = subprocess.run(cmd, env=mpiexec_env(), capture_output=True, text=True, timeout=110)
        assert done.returncode == 0, done.stderr[-3000:]
        assert out.read_bytes()[:8] == PNG


def test_without_matplotlib_the_hint_installs_it_from_where_it_is(runs, tmp_path, capsys, monkeypatch):
    """mpistrat is installed from a clone, not a package index: the hint names matplotlib itself."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it imports
    assert plot.main([*runs, "-o", str(tmp_path / "x.png"), "--kind", "bandwidth"]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib: pip install matplotlib (or pip install '.[plot]' in the clone)" in err, err
    assert "mpistrat[" not in err and not (tmp_path / "x.png").exists()


def test_the_ratio_legend_says_each_line_is_mpistrat_over_a_raw_side(runs):
    """On the ratio figure no line is raw mpi4py's time: each is mpistrat's time over it."""
    import matplotlib.pyplot as plt

    loaded = [bench_report.load(path) for path in runs[:2]]
    for kind, names in (("ratio", plot._RATIOS), ("bandwidth", plot._SIDES)):
        fig = plot._per_size(plt, loaded, ["all_reduce_nest"], kind, "busbw")
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        plt.close(fig)
        sides = ["raw", "raw2"] if kind == "ratio" else ["mpistrat", "raw", "raw2"]
        assert labels == [run["meta"]["label"] for run in loaded] + [names[s] for s in sides], labels
    assert plot._RATIOS["raw"] == "mpistrat / raw mpi4py"


def test_oversubscribed_points_are_marked_as_report_marks_them(tmp_path, monkeypatch, capsys):
    """The figure ``mpistrat plot`` writes, read back: the 4-rank point (from an oversubscribed run) is
    ringed on every axis, its tick says ``4*`` as report's tables do, and the note under the figure is
    report's note, word for word; the bandwidth figure's legend marks that run ``*`` too."""
    from matplotlib.figure import Figure

    paths = []
    for ranks, crowded in ((1, False), (2, False), (4, True)):
        run = _fake_run(ranks, "strong", 10.0)
        if crowded:
            run["meta"]["oversubscribed"] = ["4 ranks on 2 logical cores of h"]
        paths.append(tmp_path / f"r{ranks}.json")
        paths[-1].write_text(json.dumps(run))
    drawn: list = []
    save = Figure.savefig

    def keep(fig, *args, **kwargs):
        drawn.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    args = [*map(str, paths), "--op", "all_reduce", "--size", "1KiB"]
    assert plot.main([*args, "-o", str(tmp_path / "s.png"), "--kind", "scaling"]) == 0
    (fig,) = drawn
    # all_reduce at 1 KiB: 10 * 2 * (1 + n/4) * 1.1 us (mpistrat's side of _fake_run), strong scaling
    t = {n: 10.0 * 2 * (1 + n / 4) * 1.1 for n in (1, 2, 4)}
    expected = [t[4], t[1] / t[4], t[1] / t[4] * 1 / 4]  # time, speed-up, efficiency at 4 ranks
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 3
    for ax, value in zip(axes, expected, strict=True):
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4*"]
        rings = [line for line in ax.get_lines() if line.get_label() == "* oversubscribed"]
        assert len(rings) == 1 and list(rings[0].get_xdata()) == [4], [
            line.get_label() for line in ax.get_lines()
        ]
        assert rings[0].get_ydata()[0] == pytest.approx(value)
        assert rings[0].get_marker() == "o" and rings[0].get_markerfacecolor() == "none"
    notes = [text.get_text() for text in fig.texts if text.get_text().startswith("*")]  # not the title
    assert notes == [f"* {bench_report.OVERSUBSCRIBED}: 4 ranks on 2 logical cores of h"], notes
    from mpistrat.tools import report

    assert report.main(list(map(str, paths))) == 0
    assert notes[0] in capsys.readouterr().out.splitlines()  # report's own note, the same line
    assert plot.main([*args, "-o", str(tmp_path / "b.png"), "--kind", "bandwidth"]) == 0
    legend = [t.get_text() for t in drawn[-1].legends[0].get_texts()]
    assert legend[:3] == ["1 ranks", "2 ranks", "4 ranks *"], legend
    assert [text.get_text() for text in drawn[-1].texts if text.get_text().startswith("*")] == notes
