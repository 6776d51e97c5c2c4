"""Collective checks over device (CuPy) arrays, shared by the GPU suite and the CPU suite's fake CuPy.

Each case takes ``(xp, strategy, comm)``: the CuPy module (real or fake), a fresh
strategy over ``comm``, and ``comm`` itself. References are serial NumPy
computations of every rank's data; every check is agreed on by all ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import mpistrat
from mpistrat import CollectiveMismatchError, CommunicationOptions, ReduceOp
from tests.conftest import RankChecks, all_ranks_agree, raises_on_every_rank


def host(x: Any) -> np.ndarray:
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def on_device(x: Any) -> bool:
    return type(x).__module__.startswith("cupy") and not isinstance(x, np.ndarray)


def local(rank: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    values = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) + 10 * rank
    return values.astype(dtype)


def agree_close(comm: Any, got: Any, want: np.ndarray, what: str, device: bool = True) -> None:
    checks = RankChecks()
    checks.that(on_device(got) == device and host(got).dtype == want.dtype and host(got).shape == want.shape)
    checks.that(np.allclose(host(got), want))
    checks.agree(comm, f"{what}: got {type(got).__name__} {host(got)!r}, want {want!r}")


def case_all_reduce_sum(xp: Any, strategy: Any, comm: Any) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    for dtype in ("float32", "float64", "int64", "int16", "complex64"):
        x = xp.asarray(local(rank, (3, 5), dtype))
        got = strategy.run(lambda v: mpistrat.get_replica_context().all_reduce("sum", v), args=(x,))
        want = sum(local(r, (3, 5), dtype) for r in range(n)).astype(dtype)
        agree_close(comm, got, want, f"sum {dtype}")
        agree_close(comm, x, local(rank, (3, 5), dtype), "input unchanged")


def case_all_reduce_mixed_nest(xp: Any, strategy: Any, comm: Any) -> None:
    """NumPy and CuPy leaves in one nest, several dtypes, small packs: each kind stays where it was."""
    n, rank = comm.Get_size(), comm.Get_rank()
    value = {
        "w": xp.asarray(local(rank, (4, 3), "float32")),
        "b": xp.asarray(local(rank, (3,), "float32")),
        "steps": xp.asarray(local(rank, (2,), "int32")),
        "host": local(rank, (2, 2), "float64"),
        "count": rank + 1,
    }
    options = CommunicationOptions(bytes_per_pack=16)

    def step(v: Any) -> Any:
        return mpistrat.get_replica_context().all_reduce(ReduceOp.MEAN, v, options=options)

    got = strategy.run(step, args=(value,))
    mean = lambda shape, dtype: sum(local(r, shape, dtype) for r in range(n)) / n  # noqa: E731
    agree_close(comm, got["w"], mean((4, 3), "float32").astype("float32"), "w")
    agree_close(comm, got["b"], mean((3,), "float32").astype("float32"), "b")
    agree_close(comm, got["steps"], mean((2,), "int32"), "steps (ints give float64)")
    agree_close(comm, got["host"], mean((2, 2), "float64"), "host leaf", device=False)
    all_ranks_agree(comm, float(got["count"]) == (n + 1) / 2, f"count {got['count']}")


def case_all_gather_uneven(xp: Any, strategy: Any, comm: Any) -> None:
    """Uneven sizes along axis, zero on some ranks, two leaves packed together, a moved axis."""
    n, rank = comm.Get_size(), comm.Get_rank()
    rows = lambda r: r % 3 + 1  # noqa: E731
    some = lambda r: 0 if r % 2 else 2  # noqa: E731
    value = (
        xp.asarray(local(rank, (rows(rank), 3), "float32")),
        xp.asarray(local(rank, (some(rank), 2), "float32")),
        xp.asarray(local(rank, (2,), "int8")),
    )
    got = strategy.run(lambda v: mpistrat.get_replica_context().all_gather(v, axis=0), args=(value,))
    agree_close(
        comm, got[0], np.concatenate([local(r, (rows(r), 3), "float32") for r in range(n)]), "packed 0"
    )
    agree_close(
        comm, got[1], np.concatenate([local(r, (some(r), 2), "float32") for r in range(n)]), "packed 1"
    )
    agree_close(comm, got[2], np.concatenate([local(r, (2,), "int8") for r in range(n)]), "int8")
    x = xp.asarray(local(rank, (2, some(rank)), "float64"))
    got = strategy.run(lambda v: mpistrat.get_replica_context().all_gather(v, axis=-1), args=(x,))
    want = np.concatenate([local(r, (2, some(r)), "float64") for r in range(n)], axis=1)
    agree_close(comm, got, want, "axis -1 with empty parts")


def case_merge_call(xp: Any, strategy: Any, comm: Any) -> None:
    """Device arrays reach merge_fn as PerReplica of device arrays; the result comes back on the device."""
    n, rank = comm.Get_size(), comm.Get_rank()

    def merge_fn(strat: Any, value: Any, scale: Any) -> Any:
        kinds = [on_device(v) for v in value.values]
        total = strat.reduce("sum", value)
        return total * scale, mpistrat.PerReplica(tuple(xp.asarray([float(i)]) for i in range(n))), kinds

    def step(x: Any) -> Any:
        return mpistrat.get_replica_context().merge_call(merge_fn, args=(x, 2.0))

    total, mine, kinds = strategy.run(step, args=(xp.asarray(local(rank, (3,), "float64")),))
    want = 2.0 * sum(local(r, (3,), "float64") for r in range(n))
    agree_close(comm, total, want, "merge result")
    agree_close(comm, mine, np.array([float(rank)]), "PerReplica component")
    all_ranks_agree(comm, kinds == [True] * n, f"merge_fn saw device arrays: {kinds}")


def case_strategy_reduce_and_gather(xp: Any, strategy: Any, comm: Any) -> None:
    """MEAN over uneven batches is the exact global mean; gather concatenates in rank order."""
    n, rank = comm.Get_size(), comm.Get_rank()
    batch = xp.asarray(local(rank, (rank + 1, 2), "float64"))
    with strategy.scope():
        mean = strategy.reduce("mean", batch, axis=0)
        gathered = strategy.gather(batch, axis=0)
    everything = np.concatenate([local(r, (r + 1, 2), "float64") for r in range(n)])
    agree_close(comm, mean, everything.mean(axis=0), "reduce mean axis 0")
    agree_close(comm, gathered, everything, "gather")


def case_mixed_kinds_mismatch(xp: Any, strategy: Any, comm: Any) -> None:
    """A rank passing NumPy where the others pass CuPy is an error on every rank, not a hang."""
    if comm.Get_size() == 1:
        return
    rank = comm.Get_rank()
    x = local(rank, (3,), "float32")
    value = x if rank == 0 else xp.asarray(x)
    raises_on_every_rank(
        comm,
        CollectiveMismatchError,
        lambda: strategy.run(lambda v: mpistrat.get_replica_context().all_reduce("sum", v), args=(value,)),
        match="cupy:float32",
    )


def case_one_array_fast_path_meets_the_nest_path(xp: Any, strategy: Any, comm: Any) -> None:
    """One device array alone takes a shorter path than a nest; a rank taking the nest path (it
    passed options) meets the others in the same collective, and the results are the sum."""
    n, rank = comm.Get_size(), comm.Get_rank()
    ctx = mpistrat.get_replica_context
    options = CommunicationOptions() if rank % 2 else None
    # (3,) twice: one shape in two dtypes, so a plan remembered for the first must not serve the second
    for shape, dtype in (((3,), "float32"), ((2, 2), "float64"), ((3,), "float64"), ((4,), "int32")):
        want = sum(local(r, shape, dtype) for r in range(n))
        for _ in range(2):  # the second call: the remembered plan
            x = xp.asarray(local(rank, shape, dtype))
            got = strategy.run(lambda v: ctx().all_reduce("sum", v, options), args=(x,))
            agree_close(comm, got, want, f"one {dtype}{list(shape)} array")
            got = strategy.run(lambda v: ctx().all_reduce("mean", v, options), args=(x,))
            agree_close(comm, got, want / n, f"the mean of one {dtype}{list(shape)} array")


def case_devices_reported(xp: Any, strategy: Any, comm: Any) -> None:
    device = strategy.run(lambda: mpistrat.get_replica_context().devices)[0]
    placement = strategy.extended.placement
    checks = RankChecks()
    checks.that(placement.gpu is not None and device.endswith(f"/device:GPU:{placement.gpu}"))
    checks.that(device.startswith(f"/job:worker/replica:0/task:{comm.Get_rank()}/"))
    checks.agree(comm, f"device {device}, placement {placement}")


def case_checkpoint_round_trip(xp: Any, strategy: Any, comm: Any) -> None:
    """Device variables and Adam's slots, replicated and sharded, saved by every rank's share
    (through host copies of the share) and restored bitwise: into device variables, into host
    variables, and a host file back onto the device."""
    for shard in (False, True):
        _checkpoint_round_trip(xp, strategy, comm, shard)


def _checkpoint_round_trip(xp: Any, strategy: Any, comm: Any, shard: bool) -> None:
    import os
    import tempfile

    folder = comm.bcast(tempfile.mkdtemp() if comm.Get_rank() == 0 else None, root=0)
    shapes = [(5, 3), (7,), ()]

    def model(module: Any, fill: float | None) -> tuple[list[Any], Any]:
        with strategy.scope():
            ws = [
                mpistrat.Variable(
                    module.asarray(local(0, s, "float32") if fill is None else np.full(s, fill, np.float32))
                )
                for s in shapes
            ]
            opt = mpistrat.optimizers.Adam(0.1, shard_state=shard)
            opt.build(ws)
        return ws, opt

    def values(ws: list[Any], opt: Any) -> list[Any]:
        with strategy.scope():
            return [w.value() for w in ws] + [opt.get_slot(w, n).value() for w in ws for n in ("m", "v")]

    ws, opt = model(xp, None)
    grads = [xp.asarray(np.ones(s, np.float32)) for s in shapes]
    strategy.run(lambda: opt.apply_gradients(zip(grads, ws, strict=True)))
    want = [host(v) for v in values(ws, opt)]
    device_file = mpistrat.Checkpoint(w=ws, opt=opt).write(os.path.join(folder, "device"))
    for module, name in ((xp, "device"), (np, "host")):
        got_ws, got_opt = model(module, -1.0)
        mpistrat.Checkpoint(w=got_ws, opt=got_opt).read(device_file).assert_consumed()
        for got, w in zip(values(got_ws, got_opt), want, strict=True):
            agree_close(comm, got, w, f"restored into {name} variables", device=module is xp)
    host_ws, host_opt = model(np, -1.0)
    mpistrat.Checkpoint(w=host_ws, opt=host_opt).read(device_file)
    host_file = mpistrat.Checkpoint(w=host_ws, opt=host_opt).write(os.path.join(folder, "host"))
    back_ws, back_opt = model(xp, -1.0)
    mpistrat.Checkpoint(w=back_ws, opt=back_opt).read(host_file).assert_consumed()
    for got, w in zip(values(back_ws, back_opt), want, strict=True):
        agree_close(comm, got, w, "a host file restored onto the device")


def case_reduce_scatter_then_all_gather_in_place(xp: Any, strategy: Any, comm: Any) -> None:
    """Sharded optimizer state's two transfers on device buffers of equal blocks: rank r's block of
    the sum lands at the start of its buffer, then each rank's block r reaches every rank. A call's
    options choose the transport (an optimizer's own); deterministic sums are exact."""
    n, rank = comm.Get_size(), comm.Get_rank()
    collectives, per = strategy.extended.collectives, 5
    ring = CommunicationOptions(implementation="RING")
    buf = xp.asarray(local(rank, (n * per,), "float32"))
    collectives.all_gather_in_place(buf, options=ring)  # before anything else: the only transport used
    used = collectives.transports.describe()
    all_ranks_agree(comm, set(used) == {"host", "RING"}, f"RING options gathered through {used}")
    for dtype in ("float32", "float64", "float16", "int16", "complex64"):
        values = [local(r, (n * per,), "float64") for r in range(n)]
        if dtype == "complex64":  # imaginary parts that differ from the real ones
            values = [v + 1j * (v[::-1] + 3) for v in values]
        mine, total = values[rank].astype(dtype), sum(values).astype(dtype)
        buf = xp.asarray(mine)
        collectives.reduce_scatter_in_place(buf)
        agree_close(comm, buf[:per], total[rank * per : (rank + 1) * per], f"{dtype} reduce-scatter")
        blocks = np.full(n * per, -1, dtype)  # only this rank's block is known before the gather
        blocks[rank * per : (rank + 1) * per] = total[rank * per : (rank + 1) * per]
        buf = xp.asarray(blocks)
        collectives.all_gather_in_place(buf)
        agree_close(comm, buf, total, f"{dtype} all-gather")
    exact = CommunicationOptions(deterministic=True)
    values = [np.linspace(-1, 1, n * per, dtype=np.float32) / (r + 3) for r in range(n)]
    want = sum(v.astype(np.float64) for v in values).astype(np.float32)  # exact, rounded once
    buf = xp.asarray(values[rank])
    collectives.reduce_scatter_in_place(buf, options=exact)
    got = host(buf[:per])
    ok = got.tobytes() == want[rank * per : (rank + 1) * per].tobytes()
    all_ranks_agree(comm, ok, f"deterministic reduce-scatter: {got!r} vs {want!r}")


def case_adam_steps_sharded_and_not(xp: Any, strategy: Any, comm: Any) -> None:
    """Adam on device variables of two dtypes, its state replicated and sharded (``shard_state``):
    weights and slots as the serial float64 NumPy reference of test_flat_optimizers has them, and
    still on the device."""
    from tests.training import test_flat_optimizers as flat

    rank, size = comm.Get_rank(), comm.Get_size()
    want = flat.reference_after("adam", size)
    for shard in (False, True):
        with strategy.scope():
            variables = {n: mpistrat.Variable(xp.asarray(flat.initial(n)), name=n) for n in flat.NAMES}
            opt = flat.make_optimizer("adam", shard)
        for t in range(flat.STEPS):
            grads = [(xp.asarray(flat.local_grad(n, t, rank)), variables[n]) for n in flat.NAMES]
            strategy.run(opt.apply_gradients, args=(grads,))
        values = {n: v.value() for n, v in variables.items()}
        slots = {f"{n}/{s}": opt.get_slot(v, s).value() for n, v in variables.items() for s in ("m", "v")}
        kept = all(on_device(x) for x in (*values.values(), *slots.values()))
        bad = flat.differences({n: host(v) for n, v in values.items()}, want.params)
        bad += flat.differences({n: host(v) for n, v in slots.items()}, flat.reference_slots(want))
        all_ranks_agree(comm, kept and not bad, f"shard_state={shard}: on device {kept}; {'; '.join(bad)}")


CASES = [
    case_all_reduce_sum,
    case_all_reduce_mixed_nest,
    case_all_gather_uneven,
    case_merge_call,
    case_strategy_reduce_and_gather,
    case_mixed_kinds_mismatch,
    case_one_array_fast_path_meets_the_nest_path,
    case_devices_reported,
    case_checkpoint_round_trip,
    case_reduce_scatter_then_all_gather_in_place,
    case_adam_steps_sharded_and_not,
]
