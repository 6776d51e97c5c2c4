"""Device all-reduce bandwidth per transport, against bare NCCL and raw mpi4py on the same buffers.

    mpiexec -n 2 python -m mpistrat.tools.bench_gpu              # 1 MiB .. 256 MiB, float32
    mpiexec -n 2 python -m mpistrat.tools.bench_gpu --json gpu.json --min 1MiB --max 64MiB

Every rank must run it (one rank per GPU for NCCL). For each message size it times,
on one CuPy buffer, an in-place sum all-reduce through:

- ``mpistrat AUTO|RING|NCCL``: ``ReplicaContext.all_reduce`` in ``strategy.run``, on a strategy made
  with that implementation;
- ``transport <name>``: the transport alone (NCCL, CUDA-aware MPI, host staging);
- ``raw nccl``: a bare ``cupy.cuda.nccl`` communicator's ``allReduce`` in place (at one rank NCCL
  then does nothing);
- ``raw nccl out of place``: a new CuPy array and the bare ``allReduce`` into it, as ``all_reduce``
  (which returns a new array) needs at the least;
- ``raw mpi4py device``: ``Allreduce(IN_PLACE)`` on the device buffer (CUDA-aware MPI only);
- ``raw mpi4py host``: ``Allreduce(IN_PLACE)`` on a host buffer of the same size.

Times are the slowest rank's mean over the timed iterations (after warm-up), with
the stream synchronized before the clock stops. ``algbw = bytes / time`` and
``busbw = algbw * 2 (n - 1) / n`` (the nccl-tests convention). Rows that a
machine cannot run (no NCCL, MPI not CUDA-aware) are left out and named.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from mpistrat.tools.sizes import parse_size

if TYPE_CHECKING:
    from mpistrat.comm.nccl import NcclTransport

__all__ = ["main", "parse_size", "sizes_between"]


def sizes_between(low: int, high: int) -> list[int]:
    """Powers of two from ``low`` to ``high`` bytes.

    >>> [s >> 20 for s in sizes_between(1 << 20, 8 << 20)]
    [1, 2, 4, 8]
    """
    sizes, size = [], 1 << max(0, (low - 1).bit_length())
    while size <= high:
        sizes.append(size)
        size <<= 1
    return sizes


def _iterations(nbytes: int, requested: int | None) -> tuple[int, int]:
    iters = requested or int(min(100, max(5, (1 << 30) // max(nbytes, 1))))
    return iters, max(2, iters // 10)


def _time(
    comm: MPI.Intracomm, sync: Callable[[], None], step: Callable[[], Any], iters: int, warmup: int
) -> float:
    """Slowest rank's mean seconds per call."""
    for _ in range(warmup):
        step()
    sync()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    elapsed = (time.perf_counter() - start) / iters
    return comm.allreduce(elapsed, op=MPI.MAX)


class Bench:
    """The contenders, set up once (strategy, transports, a bare NCCL communicator); collective."""

    def __init__(self, comm: MPI.Intracomm, cupy: Any):
        import mpistrat
        from mpistrat.comm import cuda
        from mpistrat.comm.transport import CudaAwareMPI, StagedMPI, device_capabilities, nccl_status

        self.comm, self.cupy = comm, cupy
        self.strategy = mpistrat.MPIStrategy(comm)  # places this rank on its GPU first
        # One strategy per implementation, set as users set it (a call's options take a longer path).
        self.by_implementation: dict[str, Any] = {"AUTO": self.strategy}
        caps = device_capabilities(comm, cupy)
        self.nccl_ok = caps.nccl and caps.own_gpu
        self.skipped: list[str] = []
        self.staged = StagedMPI(comm, cupy)
        aware = cuda.cuda_awareness()
        self.direct = CudaAwareMPI(comm, cupy) if aware.aware else None
        if not aware.aware:
            self.skipped.append(f"cuda-aware mpi rows: {aware.how}")
        self.nccl_transport: NcclTransport | None = None
        self.nccl: Any = None  # cupy.cuda.nccl and a bare communicator of it (CuPy is untyped)
        self.raw_nccl: Any = None
        if self.nccl_ok:
            from mpistrat.comm.nccl import NcclTransport

            self.nccl_transport = NcclTransport(comm, cupy)
            self.nccl, _ = nccl_status(cupy)
            uid = comm.bcast(self.nccl.get_unique_id() if comm.Get_rank() == 0 else None)
            self.raw_nccl = self.nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
        else:
            self.skipped.append(f"nccl rows: {caps.why_not_nccl}")

    def steps(self, buf: Any, host: np.ndarray) -> dict[str, Callable[[], Any]]:
        """Name -> one in-place sum all-reduce of ``buf`` (``host`` for the host baseline)."""
        import mpistrat
        from mpistrat.comm.nccl import nccl_reduce_type
        from mpistrat.errors import InvalidArgumentError

        comm = self.comm
        steps: dict[str, Callable[[], Any]] = {}
        device_routes = ("AUTO", "RING", "NCCL")  # HIERARCHICAL carries device buffers as RING does
        for implementation in map(mpistrat.CommunicationImplementation, device_routes):
            if implementation is mpistrat.CommunicationImplementation.NCCL and not self.nccl_ok:
                continue
            strategy = self.by_implementation.get(implementation.value)
            if strategy is None:
                options = mpistrat.CommunicationOptions(implementation=implementation)
                strategy = mpistrat.MPIStrategy(comm, communication_options=options)
                self.by_implementation[implementation.value] = strategy
            steps[f"mpistrat {implementation.value}"] = functools.partial(self._through_run, strategy, buf)
        steps["transport mpi (host staging)"] = functools.partial(self.staged.allreduce, buf, buf)
        if self.direct is not None:
            steps["transport cuda-aware mpi"] = functools.partial(self.direct.allreduce, buf, buf)
            steps["raw mpi4py device"] = functools.partial(comm.Allreduce, MPI.IN_PLACE, buf, op=MPI.SUM)
        if self.nccl_transport is not None:
            steps["transport nccl"] = functools.partial(self.nccl_transport.allreduce, buf, buf)
            nccl_type = nccl_reduce_type(self.nccl, buf.dtype)
            if nccl_type is None:
                raise InvalidArgumentError(f"raw nccl: NCCL cannot sum {buf.dtype}")
            datatype, per_item = nccl_type
            stream = self.cupy.cuda.get_current_stream()
            steps["raw nccl"] = functools.partial(
                self.raw_nccl.allReduce,
                buf.data.ptr,
                buf.data.ptr,
                buf.size * per_item,
                datatype,
                self.nccl.NCCL_SUM,
                stream.ptr,
            )
            steps["raw nccl out of place"] = functools.partial(
                self._out_of_place, buf, buf.size * per_item, datatype, stream.ptr
            )
        steps["raw mpi4py host"] = functools.partial(comm.Allreduce, MPI.IN_PLACE, host, op=MPI.SUM)
        return steps

    def _out_of_place(self, buf: Any, count: int, datatype: int, stream: int) -> Any:
        """What ``all_reduce`` does with NCCL at the least: a new result array, then the sum into it."""
        out = self.cupy.empty_like(buf)
        self.raw_nccl.allReduce(buf.data.ptr, out.data.ptr, count, datatype, self.nccl.NCCL_SUM, stream)
        return out

    @staticmethod
    def _through_run(strategy: Any, buf: Any) -> Any:
        from mpistrat.tools.replica import replica_context

        return strategy.run(lambda: replica_context().all_reduce("sum", buf))

    def close(self) -> None:
        for transport in (self.staged, self.direct, self.nccl_transport):
            if transport is not None:
                transport.close()
        if self.raw_nccl is not None:
            self.raw_nccl.destroy()
        for strategy in self.by_implementation.values():
            strategy.experimental_finalize()


def run(comm: MPI.Intracomm, sizes: list[int], dtype: str, iters: int | None) -> tuple[list[dict], list[str]]:
    """All rows (every rank gets them); collective over ``comm``."""
    import cupy

    n = comm.Get_size()
    rows: list[dict[str, Any]] = []
    bench = Bench(comm, cupy)
    sync = cupy.cuda.get_current_stream().synchronize
    try:
        for nbytes in sizes:
            count = max(1, nbytes // np.dtype(dtype).itemsize)
            buf = cupy.zeros(count, dtype=dtype)  # zeros: repeated in-place sums never overflow
            host = np.zeros(count, dtype=dtype)
            total, warmup = _iterations(nbytes, iters)
            for name, step in bench.steps(buf, host).items():
                seconds = _time(comm, sync, step, total, warmup)
                algbw = nbytes / seconds / 1e9
                rows.append(
                    {
                        "bytes": nbytes,
                        "name": name,
                        "ranks": n,
                        "iters": total,
                        "time_us": seconds * 1e6,
                        "algbw_GBps": algbw,
                        "busbw_GBps": algbw * (2 * (n - 1) / n if n > 1 else 1.0),
                    }
                )
            del buf, host
    finally:
        bench.close()
    return rows, bench.skipped


def _size_text(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


def table(rows: list[dict[str, Any]]) -> str:
    """Rows as a markdown table, one line per (size, contender)."""
    lines = ["| size | what | time (us) | algbw (GB/s) | busbw (GB/s) |", "|---:|:---|---:|---:|---:|"]
    for r in rows:
        size = _size_text(r["bytes"])
        lines.append(
            f"| {size} | {r['name']} | {r['time_us']:.1f} | {r['algbw_GBps']:.2f} | {r['busbw_GBps']:.2f} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpistrat.tools.bench_gpu", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--min", type=parse_size, default=1 << 20, help="smallest message (default 1MiB)")
    parser.add_argument("--max", type=parse_size, default=256 << 20, help="largest message (default 256MiB)")
    parser.add_argument("--dtype", default="float32", help="element type (default float32)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default: by size)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    from mpistrat.comm.devices import import_cupy

    comm = MPI.COMM_WORLD.Dup()
    cupy, why = import_cupy()
    missing = [w for w in comm.allgather(None if cupy is not None else why) if w]
    if missing:
        if comm.Get_rank() == 0:
            print(f"bench_gpu needs CuPy and a GPU on every rank: {missing[0]}", file=sys.stderr)
        return 1
    rows, skipped = run(comm, sizes_between(args.min, args.max), args.dtype, args.iters)
    if comm.Get_rank() == 0:
        print(f"# device all-reduce, {comm.Get_size()} rank(s), {args.dtype}, sum in place")
        print(table(rows))
        for reason in skipped:
            print(f"# left out: {reason}")
        if args.json:
            with open(args.json, "w") as out:
                json.dump(
                    {"ranks": comm.Get_size(), "dtype": args.dtype, "rows": rows, "left_out": skipped}, out
                )
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
