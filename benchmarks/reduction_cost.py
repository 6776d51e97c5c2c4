"""Bytes and time of one float32 all_reduce: plain, deterministic, bf16 and fp16.

    mpiexec -n 2 python -m benchmarks.reduction_cost [--sizes 4K 64K 1M 16M] [--repeat 20]

Bytes are what each rank hands to MPI, counted by tests/support/counting.py's communicator (the
handshake left out); "ring" is the bytes that leave a rank in a bandwidth-optimal algorithm
(Allreduce 2n(R-1)/R, Alltoall and Allgather n(R-1)/R). Time is the median of ``--repeat``
calls, interleaved across the modes, on rank 0's clock.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.options import CommunicationOptions
from mpistrat.tools.sizes import parse_size
from tests.support.counting import CountingComm, Ledger, ring_bytes

MODES = {
    "plain": None,
    "deterministic": CommunicationOptions(deterministic=True),
    "bf16": CommunicationOptions(compression="bf16"),
    "fp16": CommunicationOptions(compression="fp16"),
}


def ring(ledger: Ledger, size: int) -> float:
    """Bytes leaving this rank in a bandwidth-optimal algorithm, the handshake aside."""
    return sum(ring_bytes(call, size) for call in ledger.log[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[4 << 10, 64 << 10, 1 << 20, 16 << 20])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    counted = mpistrat.MPIStrategy(CountingComm(comm)).extended.collectives
    timed = mpistrat.MPIStrategy(comm).extended.collectives
    if comm.Get_rank() == 0:
        print(f"ranks {size}, float32, {MPI.Get_library_version().splitlines()[0]}")
        print(
            f"{'bytes':>8} {'mode':>13} {'sent B':>10} {'x plain':>7} {'ring x':>7} "
            f"{'median us':>10} {'x plain':>7}"
        )
    for nbytes in args.sizes:
        x = np.random.default_rng(comm.Get_rank()).standard_normal(nbytes // 4).astype(np.float32)
        rows = {}
        for name, opts in MODES.items():
            with Ledger.recording() as ledger:
                counted.all_reduce("sum", x, opts)
            rows[name] = [ledger.log[1:], ring(ledger, size)]
        times: dict[str, list[float]] = {name: [] for name in MODES}
        for _ in range(args.repeat):
            for name, opts in MODES.items():
                comm.Barrier()
                start = time.perf_counter()
                timed.all_reduce("sum", x, opts)
                times[name].append(time.perf_counter() - start)
        if comm.Get_rank() == 0:
            base_sent = sum(c.sent for c in rows["plain"][0])
            base_time = statistics.median(times["plain"])
            for name in MODES:
                sent = sum(c.sent for c in rows[name][0])
                t = statistics.median(times[name])
                print(
                    f"{nbytes:>8} {name:>13} {sent:>10} {sent / base_sent:>7.2f} "
                    f"{rows[name][1] / rows['plain'][1]:>7.2f} {t * 1e6:>10.1f} {t / base_time:>7.2f}"
                )


if __name__ == "__main__":
    main()
