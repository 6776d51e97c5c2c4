"""Where a small ``all_reduce`` spends its time: raw MPI, the handshake's floor, mpistrat with the
check off and on, each the median of five loops of ``--calls`` calls (one float32 array):

    mpiexec -n 2 python -m benchmarks.where_time_goes --bytes 4 65536 524288

"raw, new result" allocates its result at every call, as a program that keeps its results
must; "raw + handshake" is the floor with the check on: the 13-int64 ``Allreduce(MAX)`` every
collective opens with, then the data.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat import CommunicationOptions


def median_us(comm: MPI.Intracomm, call: Callable[[], object], calls: int) -> float:
    for _ in range(20):
        call()
    loops = []
    for _ in range(5):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        loops.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(loops)[2]


def cases(
    comm: MPI.Intracomm, x: np.ndarray, checked: Any, unchecked: Any
) -> dict[str, Callable[[], object]]:
    recv = np.empty_like(x)
    header, answer = np.zeros(13, np.int64), np.empty(13, np.int64)
    return {
        "raw": lambda: comm.Allreduce(x, recv, op=MPI.SUM),
        "raw, new result": lambda: comm.Allreduce(x, np.empty_like(x), op=MPI.SUM),
        "raw + handshake": lambda: (
            comm.Allreduce(header, answer, op=MPI.MAX),
            comm.Allreduce(x, recv, op=MPI.SUM),
        ),
        "mpistrat, check off": lambda: unchecked.all_reduce("sum", x),
        "mpistrat, check on": lambda: checked.all_reduce("sum", x),
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--bytes", type=int, nargs="+", default=[4, 65536, 524288])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    checked = mpistrat.MPIStrategy().extended.collectives
    off = CommunicationOptions(check=False)
    unchecked = mpistrat.MPIStrategy(communication_options=off).extended.collectives
    for nbytes in args.bytes:
        x = np.ones(max(1, nbytes // 4), np.float32)
        for name, call in cases(comm, x, checked, unchecked).items():
            us = median_us(comm, call, args.calls)
            if comm.Get_rank() == 0:
                print(f"{x.nbytes:>9} B  {name:20s} {us:8.1f} us")


if __name__ == "__main__":
    main()
