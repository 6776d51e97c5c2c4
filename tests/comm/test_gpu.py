"""The collective suite over real CuPy arrays on CUDA GPUs (``make test-gpu``, 1 and 2 ranks).

Skipped, with the reason, where CuPy or a GPU is missing; with ``MPISTRAT_REQUIRE_GPU=1``
(which ``make test-gpu`` sets) a missing GPU fails instead. Two ranks may share one
GPU: MPI with host staging (or a CUDA-aware MPI) still works, but NCCL needs one GPU
per rank, so the NCCL cases are skipped there and say so.

The transports' logic also runs without a GPU in tests/comm/test_device_paths.py.
"""

import os

import numpy as np
import pytest

import mpistrat
from mpistrat import CommunicationOptions
from mpistrat.comm import cuda, transport
from tests.conftest import WORLD, RankChecks, all_ranks_agree
from tests.support.device_cases import CASES

pytestmark = pytest.mark.gpu

REQUIRE = os.environ.get("MPISTRAT_REQUIRE_GPU", "").strip() == "1"

# (implementation, MPISTRAT_CUDA_AWARE or None for the detected value). Forcing "1" on a real
# GPU would hand device pointers to an MPI that may not read them, so only "0" is forced.
VARIANTS = [("RING", None), ("RING", "0"), ("AUTO", None), ("NCCL", None)]


def real_cupy():
    """``(cupy, "")`` when CuPy and a CUDA device are usable here, else ``(None, why)``."""
    try:
        import cupy
    except Exception as exc:
        return None, f"CuPy cannot be imported ({exc})"
    if getattr(cupy, "FAKE", False):
        return None, "only the fake CuPy is loaded"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return None, f"CUDA reports no device ({exc})"
    return (cupy, "") if count > 0 else (None, "no CUDA device is visible")


@pytest.fixture
def cp(world):
    """Real CuPy, agreed on by every rank (a rank skipping alone would strand the others)."""
    cupy, why = real_cupy()
    reasons = [w for w in WORLD.allgather(why) if w]
    if reasons:
        message = f"needs CuPy and a CUDA GPU on every rank: {reasons[0]}"
        if REQUIRE:
            pytest.fail(f"MPISTRAT_REQUIRE_GPU=1, but this {message}")
        pytest.skip(message)
    return cupy


def expected_transport(implementation, comm, cupy):
    kind, _ = transport.choose_device_transport(
        implementation, transport.device_capabilities(comm, cupy), cuda.cuda_awareness().aware
    )
    return {"nccl": "nccl", "cuda-aware": "cuda-aware mpi", "staged": "mpi (host staging)"}[kind]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-aware{v[1] or 'detected'}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_gpu_case(world, group, cp, monkeypatch, case, variant):  # world first: it places the GPU
    implementation, aware = variant
    if aware is not None:
        monkeypatch.setenv("MPISTRAT_CUDA_AWARE", aware)
    if implementation == "NCCL":
        caps = transport.device_capabilities(group.comm, cp)
        if not (caps.nccl and caps.own_gpu):  # agreed by every rank of the group
            pytest.skip(f"NCCL multi-rank cases need one GPU per rank and NCCL: {caps.why_not_nccl}")
    expected = expected_transport(implementation, group.comm, cp)
    strategy = mpistrat.MPIStrategy(
        group.comm, communication_options=CommunicationOptions(implementation=implementation)
    )
    try:
        case(cp, strategy, group.comm)
        used = strategy.extended.collectives.transports.describe().get(implementation)
        all_ranks_agree(
            group.comm, used in (None, expected), f"device packs went through {used}, not {expected}"
        )
    finally:
        strategy.experimental_finalize()


def test_results_are_ready_on_a_non_default_stream(world, cp):
    """Work queued on the caller's stream before and after the call sees the right data."""
    strategy = mpistrat.MPIStrategy(world.comm)
    try:
        with cp.cuda.Stream(non_blocking=True):
            x = cp.arange(1 << 20, dtype=cp.float32)
            x *= world.rank + 1  # still running when the collective starts
            got = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", x))
            total = float((got * 2).sum().get())
        n = world.size
        want = 2.0 * float(np.arange(1 << 20, dtype=np.float64).sum()) * n * (n + 1) / 2
        all_ranks_agree(world.comm, abs(total - want) <= 1e-5 * want, f"{total} vs {want}")
    finally:
        strategy.experimental_finalize()


def test_placement_uses_this_ranks_gpu(world, cp):
    placement = world.strategy.extended.placement
    checks = RankChecks()
    checks.that(placement.gpu is not None and cp.cuda.runtime.getDevice() == placement.gpu)
    checks.that(world.strategy.extended.worker_devices[0].endswith(f"/device:GPU:{placement.gpu}"))
    checks.agree(world.comm, f"{placement}, current device {cp.cuda.runtime.getDevice()}")
