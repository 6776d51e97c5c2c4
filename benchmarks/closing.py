"""The handshake's forms, and what ``strategy.run``'s closing costs under ``MPISTRAT_CHECK=step``.

    mpiexec -n 2 python -m benchmarks.closing [--iters 5000] [--repeats 9]

First the handshake's message (13 int64, ``MAX``) three ways, interleaved: a blocking
``Allreduce``, ``Iallreduce`` + ``Wait``, and a persistent request's ``Start`` + ``Wait`` (what
the handshake is where MPI has it). Then the closing of a step that left one collective unchecked,
layer by layer: that raw persistent handshake, ``closing.close_step`` (the handshake's
bookkeeping: its number and codes, the flight entry, the straggler tally, the comparison; and the
watch around it) and ``results.agree_on_result`` (the result's structure), beside ``agree`` alone
(the closing less its step check's and tally's marks). Then whether Python
between the handshake's ``Start`` and ``Wait`` hides in its latency: about a microsecond of
interpreted work before ``Start`` + ``Wait``, and the same work between them (where the MPI moves
the message only inside its own calls, it does not). Last, a one-array ``all_reduce`` with the
check off against the same call left unchecked (its record). Rank 0 prints microseconds per
call, median and best of the repeats, and each line's median difference to the first of its group.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.collectives import closing, handshake
from mpistrat.distribute import results


def timed(comm: MPI.Intracomm, variants: dict[str, Callable[[], object]], iters: int, repeats: int) -> None:
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):  # interleaved: a slow moment of a shared machine hits every variant
        for name, call in variants.items():
            comm.Barrier()
            began = time.perf_counter()
            for _ in range(iters):
                call()
            samples[name].append(comm.allreduce(time.perf_counter() - began, op=MPI.MAX) / iters * 1e6)
    first = next(iter(samples.values()))
    if comm.Get_rank() == 0:
        for name, v in samples.items():
            over = statistics.median(a - b for a, b in zip(v, first, strict=True))
            print(f"{name:34s} {statistics.median(v):7.2f} {min(v):7.2f} {over:+8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    send, recv = np.zeros(handshake.SLOTS, np.int64), np.empty(handshake.SLOTS, np.int64)
    messages = ([send, MPI.INT64_T], [recv, MPI.INT64_T])
    persistent = handshake.persistent(comm, send, recv)
    if persistent is None:
        raise SystemExit("needs 2 ranks or more and an MPI with persistent collectives (MPI-4)")

    def start_wait() -> None:
        persistent.Start()
        persistent.Wait()

    if comm.Get_rank() == 0:
        print(f"{comm.Get_size()} ranks; microseconds per call: median, best, median over the first line")
        print("the handshake's message, 13 int64 MAX")
    timed(
        comm,
        {
            "blocking Allreduce": lambda: comm.Allreduce(messages[0], messages[1], MPI.MAX),
            "Iallreduce + Wait": lambda: comm.Iallreduce(messages[0], messages[1], MPI.MAX).Wait(),
            "persistent Start + Wait": start_wait,
        },
        args.iters,
        args.repeats,
    )

    check = mpistrat.CommunicationOptions(check="step")
    strategy = mpistrat.MPIStrategy(comm, communication_options=check)
    x = np.ones(8)
    for _ in range(2):  # the first step is checked call by call; the second closes the learning
        strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", x))
    collectives = strategy.extended.collectives
    record = collectives.step_check.record  # type: ignore[union-attr]
    unchecked = (1, "all_reduce", 12345)  # what one unchecked collective leaves in it
    result = [x] * 8

    def raw() -> None:
        record.extend(unchecked)
        record.clear()
        start_wait()

    def close() -> None:
        record.extend(unchecked)
        closing.close_step(collectives, results.KIND, lambda: 5, lambda: None)

    def structured() -> None:
        record.extend(unchecked)
        results.agree_on_result(collectives, result, None)

    def agree() -> None:
        record.extend(unchecked)
        collectives.agree(results.KIND, fingerprint=5)

    if comm.Get_rank() == 0:
        print("strategy.run's closing under MPISTRAT_CHECK=step, one collective unchecked")
    timed(
        comm,
        {
            "raw persistent handshake": raw,
            "+ bookkeeping, watch (close_step)": close,
            "+ the result's structure": structured,
            "agree alone, for comparison": agree,
        },
        args.iters,
        args.repeats,
    )

    def work() -> None:  # about a microsecond of interpreted bookkeeping
        for _ in range(60):
            pass

    def work_then_handshake() -> None:
        work()
        start_wait()

    def handshake_around_work() -> None:
        persistent.Start()
        work()
        persistent.Wait()

    if comm.Get_rank() == 0:
        print("Python before the handshake, and between its Start and Wait")
    timed(
        comm,
        {
            "work alone": work,
            "work, then Start + Wait": work_then_handshake,
            "Start, work, Wait": handshake_around_work,
        },
        args.iters,
        args.repeats,
    )
    off = mpistrat.MPIStrategy(comm, communication_options=mpistrat.CommunicationOptions(check=False))

    plain = off.extended.collectives

    def unchecked_call() -> None:
        collectives.all_reduce("sum", x)
        record.clear()  # the closing's work, timed above

    if comm.Get_rank() == 0:
        print("a one-array all_reduce (the collectives' own, below the replica context)")
    calls = {
        "check off": lambda: plain.all_reduce("sum", x),
        "unchecked (MPISTRAT_CHECK=step)": unchecked_call,
    }
    timed(comm, calls, args.iters, args.repeats)
    persistent.Free()
    strategy.experimental_finalize()
    off.experimental_finalize()


if __name__ == "__main__":
    main()
