"""The device code paths (CUDA-aware MPI, pinned host staging, NCCL) on a NumPy-backed fake CuPy.

These run everywhere, GPU or not: the fake keeps "device" memory on the host, so
each transport's logic (stream synchronization, staging buffers, NCCL padding
and dtype fallbacks, transport choice) is exercised at every rank count. The
real-GPU suite is tests/comm/test_gpu.py.
"""

import math

import numpy as np
import pytest

import mpistrat
from mpistrat import CommunicationOptions
from mpistrat.comm.transport import StagedMPI
from tests.conftest import WORLD, RankChecks, all_ranks_agree
from tests.support import fake_cupy
from tests.support.counting import CountingComm, Ledger
from tests.support.device_cases import CASES

# (implementation, MPISTRAT_CUDA_AWARE, the transport that must carry device packs)
VARIANTS = [
    ("RING", "1", "cuda-aware mpi"),
    ("RING", "0", "mpi (host staging)"),
    ("AUTO", "0", "nccl"),
    ("NCCL", "1", "nccl"),
]


@pytest.fixture
def fake(monkeypatch):
    return fake_cupy.install(monkeypatch)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-aware{v[1]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_device_case(group, fake, monkeypatch, case, variant):
    implementation, aware, expected = variant
    monkeypatch.setenv("MPISTRAT_CUDA_AWARE", aware)
    options = CommunicationOptions(implementation=implementation)
    strategy = mpistrat.MPIStrategy(group.comm, communication_options=options)
    try:
        case(fake, strategy, group.comm)
        used = strategy.extended.collectives.transports.describe().get(implementation)
        all_ranks_agree(group.comm, used in (None, expected), f"device packs went through {used}")
    finally:
        strategy.experimental_finalize()


def test_cuda_aware_path_synchronizes_the_stream_first(group, fake, monkeypatch):
    monkeypatch.setenv("MPISTRAT_CUDA_AWARE", "1")
    strategy = mpistrat.MPIStrategy(
        group.comm, communication_options=CommunicationOptions(implementation="RING")
    )
    try:
        fake.calls.clear()
        strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", fake.ones(3)))
        all_ranks_agree(group.comm, "stream.synchronize" in fake.calls, f"calls: {fake.calls}")
    finally:
        strategy.experimental_finalize()


def test_staging_buffer_is_reused_and_grown(group, fake):
    allocations = []
    pinned = fake.cuda.alloc_pinned_memory
    fake.cuda.alloc_pinned_memory = lambda n: allocations.append(n) or pinned(n)
    staged = StagedMPI(group.comm, fake)
    x = fake.asarray(np.arange(10, dtype=np.float64))
    for _ in range(3):
        out = fake.empty(10, dtype=np.float64)
        staged.allreduce(x, out)
    big = fake.asarray(np.ones(300_000))  # 2.4 MB: more than the first buffer (1 MiB)
    staged.allreduce(big, big)
    checks = RankChecks()
    checks.that(allocations == [1 << 20, 1 << 22])
    checks.that(np.array_equal(out.get(), np.arange(10) * group.size) and (big.get() == group.size).all())
    checks.agree(group.comm, f"allocations {allocations}")
    staged.close()


def test_nccl_reduces_unsupported_dtypes_through_mpi(group, fake, monkeypatch):
    monkeypatch.setenv("MPISTRAT_CUDA_AWARE", "0")
    strategy = mpistrat.MPIStrategy(
        group.comm, communication_options=CommunicationOptions(implementation="NCCL")
    )
    try:
        fake.calls.clear()
        x = fake.asarray(np.arange(4, dtype=np.int16))
        got = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", x))
        ok = got.get().tolist() == [i * group.size for i in range(4)] and "nccl.allReduce" not in fake.calls
        all_ranks_agree(group.comm, ok, f"{got!r} {fake.calls}")
    finally:
        strategy.experimental_finalize()


def test_nccl_refused_when_ranks_share_a_gpu(world, fake, monkeypatch):
    """One visible device per node: ranks share it, so explicit NCCL is an error on every rank."""
    from mpistrat import InvalidArgumentError
    from tests.conftest import raises_on_every_rank

    monkeypatch.setenv("FAKE_CUPY_DEVICES", "1")
    monkeypatch.setenv("MPISTRAT_CUDA_AWARE", "0")
    options = CommunicationOptions(implementation="NCCL")
    strategy = mpistrat.MPIStrategy(world.comm, communication_options=options)
    x = fake.ones(2)
    try:
        if world.size == 1:
            got = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", x))
            assert got.get().tolist() == [1.0, 1.0]
            return
        raises_on_every_rank(
            world.comm,
            InvalidArgumentError,
            lambda: strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", x)),
            match="share one GPU",
        )
        # RING works on the same strategy afterwards: the collectives stayed in step.
        got = strategy.run(
            lambda: mpistrat.get_replica_context().all_reduce(
                "sum", x, CommunicationOptions(implementation="RING")
            )
        )
        all_ranks_agree(world.comm, got.get().tolist() == [world.size] * 2, f"{got!r}")
    finally:
        strategy.experimental_finalize()


def test_ranks_disagreeing_on_implementation_get_an_error(world, fake):
    from mpistrat import CollectiveMismatchError
    from tests.conftest import raises_on_every_rank

    if world.size == 1:
        pytest.skip("needs two ranks to disagree")
    strategy = mpistrat.MPIStrategy(world.comm)
    options = CommunicationOptions(implementation="RING" if world.rank == 0 else "NCCL")
    try:
        raises_on_every_rank(
            world.comm,
            CollectiveMismatchError,
            lambda: strategy.run(
                lambda: mpistrat.get_replica_context().all_reduce("sum", fake.ones(2), options)
            ),
            match="different CommunicationOptions.implementation: rank 0: RING; rank",
        )
    finally:
        strategy.experimental_finalize()


def test_auto_falls_back_to_mpi_when_ranks_share_a_gpu(world, fake, monkeypatch):
    monkeypatch.setenv("FAKE_CUPY_DEVICES", "1")
    monkeypatch.setenv("MPISTRAT_CUDA_AWARE", "0")
    strategy = mpistrat.MPIStrategy(world.comm)
    try:
        got = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", fake.ones(2)))
        used = strategy.extended.collectives.transports.describe()["AUTO"]
        want = "nccl" if world.size == 1 else "mpi (host staging)"
        all_ranks_agree(
            world.comm, used == want and got.get().tolist() == [world.size] * 2, f"{used} {got!r}"
        )
    finally:
        strategy.experimental_finalize()


def test_a_device_buffer_never_reaches_a_host_only_mpi(fake, monkeypatch):
    from mpistrat import UnsupportedTypeError
    from mpistrat.comm.mpi import buffer_spec

    monkeypatch.setenv("MPISTRAT_CUDA_AWARE", "0")
    with pytest.raises(UnsupportedTypeError, match="not known to be CUDA-aware"):
        buffer_spec(fake.ones(2))
    monkeypatch.setenv("MPISTRAT_CUDA_AWARE", "1")
    assert buffer_spec(fake.ones(2))[1] == 2


def _host_and_device_steps(fake, make, start):
    """Two steps of ``make()``'s optimizer on host variables, then on device ones (``start(shape)``
    their values): each side's MPI calls in the second step, and its weights."""
    rank, shapes = WORLD.Get_rank(), [(300,), (7, 5), ()]
    ledgers, weights = {}, {}
    for name, xp in (("host", np), ("device", fake)):
        options = CommunicationOptions(implementation="RING", bytes_per_pack=512)
        strategy = mpistrat.MPIStrategy(CountingComm(WORLD), communication_options=options)
        try:
            with strategy.scope():
                ws = [mpistrat.Variable(xp.asarray(start(s))) for s in shapes]
                opt = make()
            grads = [xp.asarray(np.full(s, rank + 1, np.float32)) for s in shapes]
            strategy.run(opt.apply_gradients, args=(list(zip(grads, ws, strict=True)),))
            with Ledger.recording() as ledger:
                strategy.run(opt.apply_gradients, args=(list(zip(grads, ws, strict=True)),))
            ledgers[name] = [(c.name, c.sent, c.received) for c in ledger.log]
            weights[name] = [np.asarray(fake.asnumpy(w.value()) if xp is fake else w.value()) for w in ws]
        finally:
            strategy.experimental_finalize()
    return ledgers, weights


@pytest.mark.parametrize("aware", ["1", "0"], ids=["cuda-aware", "staged"])
def test_a_sharded_device_step_moves_what_the_host_step_moves(fake, monkeypatch, aware):
    """Sharded Adam on device variables makes the host step's MPI calls with the host step's bytes
    (per pack a reduce-scatter and an all-gather: test_scaling counts those against a ring), and
    ends with the same weights."""
    monkeypatch.setenv("MPISTRAT_CUDA_AWARE", aware)
    ledgers, weights = _host_and_device_steps(
        fake, lambda: mpistrat.optimizers.Adam(0.1, shard_state=True), lambda s: np.ones(s, np.float32)
    )
    sharded = WORLD.Get_size() == 1 or any(c[0] == "Reduce_scatter_block" for c in ledgers["host"])
    same = all(np.array_equal(d, h) for d, h in zip(weights["device"], weights["host"], strict=True))
    ok = sharded and ledgers["device"] == ledgers["host"] and same
    all_ranks_agree(WORLD, ok, f"device {ledgers['device']} against host {ledgers['host']}; weights {same}")


@pytest.mark.parametrize(
    "make",
    [
        lambda: mpistrat.optimizers.Lamb(0.1, global_clipnorm=1.0, use_ema=True, shard_state=True),
        lambda: mpistrat.optimizers.AdamW(0.1, clipnorm=0.5, shard_state=True),
        lambda: mpistrat.optimizers.RMSprop(0.1, momentum=0.5, centered=True, clipvalue=0.8),
        lambda: mpistrat.optimizers.Adagrad(0.1, loss_scale_factor=4.0, shard_state=True),
    ],
    ids=["lamb", "adamw", "rmsprop", "adagrad"],
)
def test_the_keras_optimizers_on_device_variables_match_the_host(fake, monkeypatch, make):
    """Every optimizer and the base arguments that add norms, clipping and averages on device
    variables: the host step's MPI calls and bytes, and the host step's weights."""
    monkeypatch.setenv("MPISTRAT_CUDA_AWARE", "1")
    ledgers, weights = _host_and_device_steps(
        fake, make, lambda s: np.linspace(-1, 1, math.prod(s), dtype=np.float32).reshape(s)
    )
    same = all(
        np.allclose(d, h, rtol=1e-6, atol=1e-7)
        for d, h in zip(weights["device"], weights["host"], strict=True)
    )
    ok = ledgers["device"] == ledgers["host"] and same
    all_ranks_agree(WORLD, ok, f"device {ledgers['device']} against host {ledgers['host']}; weights {same}")
