"""The GPU bandwidth script's plumbing, on the fake CuPy (the numbers themselves need a GPU)."""

import json

from mpistrat.tools import bench_gpu
from tests.conftest import WORLD, all_ranks_agree
from tests.support import fake_cupy


def test_sizes():
    assert bench_gpu.sizes_between(1 << 20, 256 << 20) == [1 << s for s in range(20, 29)]
    assert bench_gpu.sizes_between(3000, 9000) == [4096, 8192]


def test_runs_every_contender_on_the_fake(tmp_path, monkeypatch):
    fake_cupy.install(monkeypatch)
    monkeypatch.setenv("MPISTRAT_CUDA_AWARE", "1")
    path = str(tmp_path / "gpu.json")
    assert bench_gpu.main(["--min", "1KiB", "--max", "2KiB", "--iters", "2", "--json", path]) == 0
    if WORLD.Get_rank() != 0:  # rank 0 writes the report
        all_ranks_agree(WORLD, True)
        return
    with open(path) as f:
        report = json.load(f)
    names = {r["name"] for r in report["rows"]}
    want = {
        "mpistrat AUTO",
        "mpistrat RING",
        "mpistrat NCCL",
        "transport nccl",
        "raw nccl",
        "raw nccl out of place",
    }
    want |= {
        "transport mpi (host staging)",
        "transport cuda-aware mpi",
        "raw mpi4py device",
        "raw mpi4py host",
    }
    sizes = sorted({r["bytes"] for r in report["rows"]})
    ok = names == want and sizes == [1024, 2048] and all(r["time_us"] > 0 for r in report["rows"])
    all_ranks_agree(WORLD, ok, f"{sorted(names)} {sizes}")
