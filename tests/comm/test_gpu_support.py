"""CPU-side pieces of GPU support: CUDA-awareness detection, device placement, transport choice."""

import ctypes
import ctypes.util
import importlib.util
import socket

import numpy as np
import pytest

from mpistrat import InvalidArgumentError, config
from mpistrat.comm import cuda, devices, nccl, transport
from mpistrat.comm.transport import DeviceCapabilities, choose_device_transport
from tests.conftest import RankChecks, all_ranks_agree, raises_on_every_rank, setting_warning
from tests.support import fake_cupy

# -- fake MPI libraries for detection ------------------------------------------------------


class NoQuery:
    """A library that has neither query symbol (getattr raises AttributeError, as ctypes does)."""


class OpenMPILike:
    def __init__(self, answer):
        self.MPIX_Query_cuda_support = lambda: answer


class MPICHLike:
    """Only MPIX_GPU_query_support(int gpu_type, int *is_supported), as MPICH 4.0."""

    def __init__(self, answer, status=0):
        def query(gpu_type, flag):
            self.asked = gpu_type
            flag.contents.value = answer
            return status

        self.MPIX_GPU_query_support = query


class Asserting:
    def MPIX_Query_cuda_support(self):
        raise OSError("exception: access violation")


def run_detect(*libraries, env=None, version="MPICH Version: 4.2"):
    named = [(f"lib{i}", lib) for i, lib in enumerate(libraries)]
    return cuda.detect(libraries=named, env=env or {}, library_version=version)


@pytest.mark.parametrize("answer", [0, 1])
def test_open_mpi_query(answer):
    got = run_detect(OpenMPILike(answer))
    assert got == cuda.CudaAwareness(bool(answer), f"MPIX_Query_cuda_support() returned {answer} in lib0")


@pytest.mark.parametrize("answer", [0, 1])
def test_mpich_query_asks_for_cuda(answer):
    lib = MPICHLike(answer)
    got = run_detect(lib)
    assert lib.asked == cuda.MPIX_GPU_SUPPORT_CUDA == 0
    assert got.aware is bool(answer)
    assert got.how == f"MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) returned {answer} in lib0"


def test_missing_symbol_moves_on_to_the_next_library():
    got = run_detect(NoQuery(), OpenMPILike(1))
    assert got.aware and got.how.endswith("in lib1")


def test_no_query_anywhere_is_not_aware_and_says_how_to_override():
    got = run_detect(NoQuery(), NoQuery())
    assert not got.aware
    assert (
        "no CUDA-awareness query" in got.how
        and "lib0, lib1" in got.how
        and "MPISTRAT_CUDA_AWARE=1" in got.how
    )


@pytest.mark.parametrize(
    "bad",
    [Asserting(), OpenMPILike(7), MPICHLike(1, status=1), MPICHLike(-3)],
    ids=["raises", "7", "err", "-3"],
)
def test_a_query_that_misbehaves_is_no_answer(bad):
    assert run_detect(bad) == run_detect(NoQuery())


def test_a_real_library_without_the_symbols():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    assert cuda.query_library(libc) is None


def test_the_loaded_mpi_library_is_queried():
    got = cuda.detect(env={})
    assert isinstance(got.aware, bool)
    assert "returned" in got.how or "no CUDA-awareness query" in got.how, got.how
    assert cuda.mpi_libraries(), "the MPI library mpi4py loaded was not found"


@pytest.mark.parametrize(
    ("value", "aware"), [("1", True), ("0", False), ("true", True), ("off", False), (" 1 ", True)]
)
def test_environment_override(value, aware):
    got = run_detect(OpenMPILike(int(not aware)), env={"MPISTRAT_CUDA_AWARE": value})
    assert got.aware is aware and "MPISTRAT_CUDA_AWARE" in got.how and "in the environment" in got.how


def test_environment_override_of_this_process(monkeypatch):
    monkeypatch.setenv("MPISTRAT_CUDA_AWARE", "1")
    assert cuda.cuda_awareness().aware
    monkeypatch.setenv("MPISTRAT_CUDA_AWARE", "0")
    assert not cuda.cuda_awareness().aware


def test_an_unknown_override_is_ignored_and_reported():
    with setting_warning("MPISTRAT_CUDA_AWARE='maybe' is not 1/true"):
        got = run_detect(OpenMPILike(1), env={"MPISTRAT_CUDA_AWARE": "maybe"})
    assert got.aware and got.how.startswith("MPISTRAT_CUDA_AWARE='maybe' is not 0 or 1 and was ignored")


def test_documented_switches_without_a_query():
    env = {"MPICH_GPU_SUPPORT_ENABLED": "1"}
    assert run_detect(NoQuery(), env=env, version="MPI VERSION    : CRAY MPICH version 8.1.28").aware
    assert not run_detect(NoQuery(), env={}, version="CRAY MPICH version 8.1.28").aware
    assert not run_detect(NoQuery(), env=env, version="Open MPI v4.1.6").aware
    assert run_detect(NoQuery(), env={"MV2_USE_CUDA": "1"}, version="MVAPICH2 Version 2.3.7").aware
    # A query's answer wins over a switch.
    assert not run_detect(OpenMPILike(0), env=env, version="CRAY MPICH version 8.1.28").aware


# -- placement ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("local", "visible", "want"), [(0, 4, 0), (5, 4, 1), (3, 1, 0), (2, 0, None)])
def test_choose_gpu(local, visible, want):
    assert devices.choose_gpu(local, visible) == want


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, None),
        ("", []),
        ("-1", []),
        ("0,1", ["0", "1"]),
        ("GPU-ab12, 3", ["GPU-ab12", "3"]),
        ("2,-1,3", ["2"]),
    ],
)
def test_visible_from_env(value, want):
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert devices.visible_from_env(env) == want


def node_local_reference(comm):
    hosts = comm.allgather(socket.gethostname())
    me = comm.Get_rank()
    return sum(h == hosts[me] for h in hosts[:me]), hosts.count(hosts[me])


def test_cpu_placement_reports_the_cpu_device(group):
    got = devices.place(group.comm, {"MPISTRAT_DEVICE": "cpu"})
    checks = RankChecks()
    checks.that((got.local_rank, got.local_size) == node_local_reference(group.comm) and got.gpu is None)
    checks.that(got.device(group.rank) == f"/job:worker/replica:0/task:{group.rank}/device:CPU:0")
    checks.agree(group.comm, repr(got))


def test_hidden_gpus_mean_cpu(group):
    got = devices.place(group.comm, {"CUDA_VISIBLE_DEVICES": ""})
    all_ranks_agree(group.comm, got.gpu is None and "hides every GPU" in got.reason, repr(got))


def test_a_bad_device_mode_warns_and_places_as_auto(group):
    env = {"MPISTRAT_DEVICE": "tpu"}
    config._warned.discard(("MPISTRAT_DEVICE", "tpu"))
    with setting_warning("MPISTRAT_DEVICE='tpu' is not auto, gpu or cpu"):
        got = devices.place(group.comm, env, select=False)
    want = devices.place(group.comm, {}, select=False)
    all_ranks_agree(group.comm, got == want, f"{got} {want}")


def test_gpu_requested_without_cupy_raises_on_every_rank(group):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    env = {"MPISTRAT_DEVICE": "gpu"}
    raises_on_every_rank(
        group.comm, InvalidArgumentError, lambda: devices.place(group.comm, env), "not installed"
    )


def test_gpu_placement_round_robin_over_visible_devices(group, monkeypatch):
    fake = fake_cupy.install(monkeypatch)
    monkeypatch.setenv("FAKE_CUPY_DEVICES", "2")
    got = devices.place(group.comm, {"CUDA_VISIBLE_DEVICES": "3,5"})
    local, _ = node_local_reference(group.comm)
    checks = RankChecks()
    checks.that(got.gpu == local % 2 and fake.cuda.runtime.getDevice() == local % 2)
    checks.that(f"CUDA_VISIBLE_DEVICES entry {'35'[local % 2]}" in got.reason)
    checks.that(got.device(group.rank).endswith(f"/device:GPU:{local % 2}"))
    checks.agree(group.comm, repr(got))


def test_strategy_reports_its_gpu(group, monkeypatch):
    import mpistrat

    fake_cupy.install(monkeypatch)
    strategy = mpistrat.MPIStrategy(group.comm)
    try:
        local, _ = node_local_reference(group.comm)
        want = (f"/job:worker/replica:0/task:{group.rank}/device:GPU:{local % 8}",)
        devs = strategy.run(lambda: mpistrat.get_replica_context().devices)
        all_ranks_agree(group.comm, devs == want == strategy.extended.worker_devices, f"{devs} vs {want}")
    finally:
        strategy.experimental_finalize()


# -- transport choice ---------------------------------------------------------------------------

BOTH = DeviceCapabilities(nccl=True, own_gpu=True, why_not_nccl="")
SHARED = DeviceCapabilities(
    nccl=True, own_gpu=False, why_not_nccl="NCCL needs one GPU per rank, but ranks [0, 1]"
)
NO_NCCL = DeviceCapabilities(nccl=False, own_gpu=True, why_not_nccl="NCCL is not available on rank 1: x")


@pytest.mark.parametrize(
    ("implementation", "caps", "aware", "want"),
    [
        ("AUTO", BOTH, False, "nccl"),
        ("AUTO", BOTH, True, "nccl"),
        ("AUTO", SHARED, True, "cuda-aware"),
        ("AUTO", SHARED, False, "staged"),
        ("AUTO", NO_NCCL, True, "cuda-aware"),
        ("AUTO", NO_NCCL, False, "staged"),
        ("RING", BOTH, True, "cuda-aware"),
        ("RING", BOTH, False, "staged"),
        ("NCCL", BOTH, False, "nccl"),
    ],
)
def test_choose_device_transport(implementation, caps, aware, want):
    kind, reason = choose_device_transport(implementation, caps, aware)
    assert kind == want and reason


@pytest.mark.parametrize("caps", [SHARED, NO_NCCL])
def test_nccl_requested_but_unusable_says_why(caps):
    with pytest.raises(InvalidArgumentError, match="implementation=NCCL was requested") as info:
        choose_device_transport("NCCL", caps, True)
    assert caps.why_not_nccl in str(info.value) and "RING or AUTO" in str(info.value)


def test_capabilities_without_cupy(group):
    caps = transport.device_capabilities(group.comm, None)
    all_ranks_agree(group.comm, not caps.nccl and "CuPy is not installed" in caps.why_not_nccl, repr(caps))


def test_capabilities_with_one_gpu_per_rank(group, monkeypatch):
    fake = fake_cupy.install(monkeypatch)
    devices.place(group.comm)
    caps = transport.device_capabilities(group.comm, fake)
    all_ranks_agree(group.comm, caps == BOTH, repr(caps))


@pytest.mark.parametrize(
    ("dtype", "want"),
    [
        ("float32", (7, 1)),
        ("float64", (8, 1)),
        ("int64", (4, 1)),
        ("uint8", (1, 1)),
        ("float16", (6, 1)),
        ("complex128", (8, 2)),
        ("int16", None),
        ("uint16", None),
    ],
)
def test_nccl_reduce_types(dtype, want):
    assert nccl.nccl_reduce_type(fake_cupy.nccl, np.dtype(dtype)) == want


@pytest.mark.parametrize(("code", "want"), [(21803, "2.18.3"), (2708, "2.7.8"), (22304, "2.23.4")])
def test_nccl_version_string(code, want):
    assert transport.version_string(code) == want


def test_a_later_strategy_keeps_the_device_of_the_first(world, monkeypatch):
    """A strategy over COMM_SELF must not move the process to GPU 0 (local rank 0 in COMM_SELF)."""
    checks = RankChecks()
    import mpistrat
    from mpistrat.comm import devices as placement_module

    monkeypatch.setattr(placement_module, "_selected", {})
    fake = fake_cupy.install(monkeypatch)
    first = mpistrat.MPIStrategy(world.comm)
    second = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
    try:
        local, _ = node_local_reference(world.comm)
        want = f"device:GPU:{local % 8}"
        checks.that(
            first.extended.worker_devices[0].endswith(want)
            and second.extended.worker_devices[0].endswith(want)
        )
        checks.that(fake.cuda.runtime.getDevice() == local % 8)
        checks.agree(world.comm, f"{first.extended.worker_devices} {second.extended.worker_devices}")
    finally:
        first.experimental_finalize()
        second.experimental_finalize()
