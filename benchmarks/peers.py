"""All-reduce per call: mpistrat next to raw mpi4py and a peer framework, in the same run.

The peers are TensorFlow's ``MultiWorkerMirroredStrategy`` (``--peer tf``: a ``tf.function``
whose replica function calls ``get_replica_context().all_reduce(SUM, x)``, the collective ring
over gRPC) and ``torch.distributed`` with the gloo backend (``--peer torch``:
``dist.all_reduce(t)``). Neither is a dependency of mpistrat: install each in a scratch venv
beside mpistrat and run this script there under ``mpiexec`` (``docs/performance.md`` has the
commands)::

    python3 -m venv /tmp/peers/torch && /tmp/peers/torch/bin/pip install torch ".[mpich]"
    /tmp/peers/torch/bin/mpiexec -n 2 /tmp/peers/torch/bin/python -m benchmarks.peers --peer torch

Every rank is one worker of the peer (rank and size from MPI; rank 0 picks free local ports and
broadcasts them), so the three sides run on the same processes and the same cores. For each
size, each side runs ``--repeats`` blocks of ``iters`` calls, the sides taking turns block by
block; a block's time is the slowest rank's, and a call's time is the median over blocks of
block time / iters. Every side's result is checked once against the known sum. Rank 0 prints a
table and, with ``--json``, writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.tools.bench_report import human
from mpistrat.tools.replica import replica_context
from mpistrat.tools.sizes import parse_size


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _tf(
    comm: MPI.Intracomm,
) -> tuple[str, Callable[[np.ndarray], Callable[[], Any]], Callable[[Any], np.ndarray]]:
    rank, size = comm.Get_rank(), comm.Get_size()
    ports = comm.bcast(_free_ports(size) if rank == 0 else None, root=0)
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": [f"localhost:{p}" for p in ports]}, "task": {"type": "worker", "index": rank}}
    )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)

    def make(x: np.ndarray) -> Callable[[], Any]:
        value = tf.constant(x)

        @tf.function
        def step() -> Any:
            def fn() -> Any:
                return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)

            return strategy.run(fn)

        return step

    return f"TensorFlow {tf.__version__} MultiWorkerMirroredStrategy (RING)", make, lambda out: out.numpy()


def _torch(
    comm: MPI.Intracomm,
) -> tuple[str, Callable[[np.ndarray], Callable[[], Any]], Callable[[Any], np.ndarray]]:
    import torch
    import torch.distributed as dist

    rank, size = comm.Get_rank(), comm.Get_size()
    port = comm.bcast(_free_ports(1)[0] if rank == 0 else None, root=0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)

    def make(x: np.ndarray) -> Callable[[], Any]:
        source = torch.from_numpy(x.copy())
        buffer = source.clone()

        def step() -> Any:
            buffer.copy_(source)  # in place, as DDP's buckets; the copy is a few ns per element
            dist.all_reduce(buffer)
            return buffer

        return step

    return f"torch {torch.__version__} torch.distributed gloo", make, lambda out: out.numpy()


def _block(comm: MPI.Intracomm, call: Callable[[], Any], iters: int) -> float:
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return comm.allreduce(time.perf_counter() - start, op=MPI.MAX) / iters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", choices=("tf", "torch", "none"), required=True)
    parser.add_argument("--sizes", default="4,64KiB,4MiB", help="comma-separated message sizes (float32)")
    parser.add_argument("--iters", type=int, default=200, help="calls per block up to 8 KiB, fewer above")
    parser.add_argument(
        "--repeats", type=int, default=7, help="blocks per side and size (the median is kept)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the table as JSON (rank 0)")
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    comm = world.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    peer_name, make, to_numpy = (None, None, None)
    if args.peer == "tf":
        peer_name, make, to_numpy = _tf(comm)
    elif args.peer == "torch":
        peer_name, make, to_numpy = _torch(comm)
    strategy = mpistrat.MPIStrategy(world)
    rows = []
    for nbytes in [parse_size(s) for s in args.sizes.split(",")]:
        count = max(1, nbytes // 4)
        x = np.full(count, rank + 1, np.float32)
        want = np.full(count, size * (size + 1) / 2, np.float32)
        recv = np.empty_like(x)
        iters = max(5, min(args.iters, args.iters * (8 << 10) // max(nbytes, 1)))

        def raw(x: np.ndarray = x, recv: np.ndarray = recv) -> Any:
            comm.Allreduce(x, recv, op=MPI.SUM)
            return recv

        sides: dict[str, Callable[[], Any]] = {"raw": raw}
        checks: dict[str, Callable[[Any], bool]] = {"raw": lambda out, want=want: np.array_equal(out, want)}
        if make is not None and to_numpy is not None:
            sides["peer"] = make(x)
            checks["peer"] = lambda out, f=to_numpy, want=want: np.array_equal(f(out), want)
        ok = {name: bool(checks[name](call())) for name, call in sides.items()}
        ok["mpistrat"] = bool(
            strategy.run(lambda x=x, want=want: np.array_equal(replica_context().all_reduce("sum", x), want))
        )
        times: dict[str, list[float]] = {name: [] for name in [*sides, "mpistrat"]}
        for call in sides.values():  # warm up
            _block(comm, call, max(1, iters // 5))
        for _ in range(args.repeats):
            for name, call in sides.items():
                times[name].append(_block(comm, call, iters))
            times["mpistrat"].append(_mpistrat_block(strategy, comm, x, iters))
        row = {
            "bytes": nbytes,
            "iters": iters,
            **{f"{k}_us": statistics.median(v) * 1e6 for k, v in times.items()},
        }
        row["ok"] = all(comm.allgather(all(ok.values())))
        rows.append(row)
    if rank == 0:
        _print(rows, size, peer_name)
        if args.json:
            meta = {
                "ranks": size,
                "peer": peer_name,
                "mpistrat": mpistrat.__version__,
                "mpi_library": " ".join(MPI.Get_library_version().split())[:120],
                "command": ["mpiexec", "-n", str(size), "python", "-m", "benchmarks.peers", *sys.argv[1:]],
            }
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": rows}, f, indent=1)
    strategy.experimental_finalize()
    comm.Free()
    return 0 if all(r["ok"] for r in rows) else 1


def _mpistrat_block(strategy: mpistrat.MPIStrategy, comm: MPI.Intracomm, x: np.ndarray, iters: int) -> float:
    def body() -> float:
        ctx = replica_context()
        return _block(comm, lambda: ctx.all_reduce("sum", x), iters)

    return float(strategy.run(body))


def _print(rows: list[dict[str, Any]], size: int, peer: str | None) -> None:
    print(
        f"{size} ranks; microseconds per all_reduce (median of blocks, slowest rank); peer: {peer or 'none'}"
    )
    head = f"{'size':>8} {'raw mpi4py':>11} {'mpistrat':>10} {'mpistrat/raw':>12}"
    if peer:
        head += f" {'peer':>11} {'peer/mpistrat':>13}"
    print(head + "  ok")
    for r in rows:
        ours, raw = r["mpistrat_us"], r["raw_us"]
        line = f"{human(r['bytes']):>8} {raw:>11.1f} {ours:>10.1f} {ours / raw:>12.2f}"
        if peer:
            line += f" {r['peer_us']:>11.1f} {r['peer_us'] / r['mpistrat_us']:>13.1f}"
        print(line + ("  yes" if r["ok"] else "  NO"))


if __name__ == "__main__":
    sys.exit(main())
