"""Where one small device ``all_reduce`` spends its time: bare NCCL, the transport alone, and
``ReplicaContext.all_reduce`` on a CuPy array (one rank, one GPU); with ``--parts``, each piece of
the call timed alone.

    python -m benchmarks.device_call --bytes 4096 --parts
    MPISTRAT_CHECK=0 python -m benchmarks.device_call --bytes 4096

Each line is the best mean over ``--repeats`` loops of ``--calls`` calls, the stream synchronized
before the clock stops; the NumPy line is the same call on a host array of the same bytes. (A
profiler does not see mpi4py's and CuPy's compiled methods: their time lands in their callers.)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import mpistrat
from mpistrat.comm.transport import StagedMPI


def best_us(step: Callable[[], Any], sync: Callable[[], None], calls: int, repeats: int) -> float:
    for _ in range(calls // 4):
        step()
    sync()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(calls):
            step()
        sync()
        best = min(best, (time.perf_counter() - began) / calls)
    return best * 1e6


def parts(strategy: Any, cupy: Any, x: Any) -> dict[str, Callable[[], Any]]:
    """The pieces of one device ``all_reduce``, each alone (``--parts``)."""
    import optree

    from mpistrat.collectives import leaves as lv
    from mpistrat.collectives.all_reduce import allreduce_arrays
    from mpistrat.collectives.fingerprint import arrays_code
    from mpistrat.comm import packing

    c = strategy.extended.collectives
    opts = c.options
    leaves, spec = lv.flatten(x, c.caches.flat)
    arrays = lv.to_arrays(x, leaves, "all_reduce")
    op = lv.reduce_op("sum")
    transport = c.transports.get(cupy, opts.implementation, x.dtype, "allreduce")
    out = cupy.empty_like(x)
    return {
        "x.shape": lambda: x.shape,
        "x.dtype": lambda: x.dtype,
        "x.flags": lambda: x.flags,
        "x.data.ptr": lambda: x.data.ptr,
        "cupy.empty(x.shape, x.dtype)": lambda: cupy.empty(x.shape, x.dtype),
        "cupy.cuda.get_current_stream()": cupy.cuda.get_current_stream,
        "packing.empty": lambda: packing.empty(x.shape, x.dtype, cupy, c.caches.buffers),
        "packing.is_device_array": lambda: packing.is_device_array(x),
        "packing.array_module": lambda: packing.array_module(x),
        "packing.is_contiguous": lambda: packing.is_contiguous(x),
        "leaves.flatten": lambda: lv.flatten(x, c.caches.flat),
        "leaves.to_arrays": lambda: lv.to_arrays(x, leaves, "all_reduce"),
        "leaves.device_implementation": lambda: lv.device_implementation(arrays, opts),
        "fingerprint.arrays_code": lambda: arrays_code(
            c.caches.codes, op, opts.implementation.value, spec, arrays, bytes_per_pack=opts.bytes_per_pack
        ),
        "packing.plan_packs": lambda: packing.plan_packs(arrays, opts.bytes_per_pack, None, c.caches.packs),
        "transports.get": lambda: c.transports.get(cupy, opts.implementation, x.dtype, "allreduce"),
        "transport.allreduce(x, out)": lambda: transport.allreduce(x, out),
        "leaves.like_leaves": lambda: lv.like_leaves(leaves, [out]),
        "optree.tree_unflatten": lambda: optree.tree_unflatten(spec, [out]),
        "allreduce_arrays": lambda: allreduce_arrays(c, arrays, opts.bytes_per_pack, opts.implementation),
        "collectives.all_reduce": lambda: c.all_reduce("sum", x),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bytes", type=int, default=4096, help="float32 bytes per call (default 4096)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--parts", action="store_true", help="also time each piece of the call alone")
    args = parser.parse_args()
    import cupy
    from cupy.cuda import nccl

    strategy = mpistrat.MPIStrategy()
    comm = strategy.extended.collectives.comm
    n = max(1, args.bytes // 4)
    x, host = cupy.ones(n, cupy.float32), np.ones(n, np.float32)
    stream = cupy.cuda.get_current_stream()
    sync = stream.synchronize
    uid = comm.bcast(nccl.get_unique_id() if comm.Get_rank() == 0 else None)
    raw = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
    staged = StagedMPI(comm, cupy)

    def out_of_place() -> Any:
        out = cupy.empty_like(x)
        raw.allReduce(x.data.ptr, out.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
        return out

    def through_run(value: Any) -> Callable[[], Any]:
        return lambda: strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", value))

    contenders: dict[str, Callable[[], Any]] = {
        "raw nccl allReduce (in place)": lambda: raw.allReduce(
            x.data.ptr, x.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr
        ),
        "cupy.empty_like + raw nccl (out of place)": out_of_place,
        "transport: host staging": lambda: staged.allreduce(x, x),
        "strategy.run(all_reduce) on CuPy": through_run(x),
        "strategy.run(all_reduce) on NumPy": through_run(host),
    }
    for name, step in contenders.items():
        print(f"{best_us(step, sync, args.calls, args.repeats):9.1f} us  {name}", flush=True)
    if args.parts:
        for name, step in parts(strategy, cupy, x).items():
            print(f"{best_us(step, sync, args.calls, args.repeats):9.2f} us    {name}", flush=True)
    staged.close()
    raw.destroy()
    strategy.experimental_finalize()


if __name__ == "__main__":
    main()
