"""Bytes each rank moves per step, by operation: the table in docs/scaling.md.

Run it at several sizes and paste the rows side by side:

    for n in 1 2 3 4 8; do mpiexec -n $n python -m benchmarks.bytes_per_rank; done

Every strategy talks on a counting communicator (tests/support/counting.py), so the numbers are
what mpistrat hands to MPI, not timings. Rank 0 prints one line per operation: the
largest bytes in + out of any rank other than 0, and rank 0's own.
"""

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat import ArrayDataset, PerReplica
from mpistrat.optimizers import SGD, Adam
from tests.support.counting import CountingComm, Ledger, ring_bytes

WORLD = MPI.COMM_WORLD
PARAMS, LEAVES = 1 << 20, 16  # 1M float32 parameters (4 MiB of gradients) in 16 leaves
S = 1 << 20  # 1 MiB per replica for merge_call and broadcast_to


def optimizer_step(make):
    strategy = mpistrat.MPIStrategy(CountingComm(WORLD))
    with strategy.scope():
        ws = [mpistrat.Variable(np.zeros(PARAMS // LEAVES, np.float32)) for _ in range(LEAVES)]
        opt = make()
        opt.build(ws)
    grads = [np.ones(PARAMS // LEAVES, np.float32) for _ in range(LEAVES)]
    step = lambda: strategy.run(lambda: opt.apply_gradients(zip(grads, ws, strict=True)))  # noqa: E731
    step()
    return step


def merge_call_per_replica():
    strategy = mpistrat.MPIStrategy(CountingComm(WORLD))
    n = strategy.num_replicas_in_sync
    parts = PerReplica([np.zeros(S // 8) for _ in range(n)])
    return lambda: strategy.run(
        lambda: mpistrat.get_replica_context().merge_call(lambda s, x: parts, args=(np.ones(1),))
    )


def merge_call_arguments():
    strategy = mpistrat.MPIStrategy(CountingComm(WORLD))
    x = np.zeros(S // 8)
    return lambda: strategy.run(
        lambda: mpistrat.get_replica_context().merge_call(lambda s, v: None, args=(x,))
    )


def broadcast_to():
    strategy = mpistrat.MPIStrategy(CountingComm(WORLD))
    x = np.zeros(S // 8)

    def step():
        with strategy.scope():
            strategy.extended.broadcast_to(x, destinations="/device:CPU:0")

    return step


def dataset_step():
    strategy = mpistrat.MPIStrategy(CountingComm(WORLD))
    data = ArrayDataset(np.zeros((1 << 16, 64), np.float32), batch_size=4096, shuffle=True)
    with strategy.scope():
        it = iter(strategy.experimental_distribute_dataset(data))
    return lambda: next(it)


OPERATIONS = {
    "optimizer step, SGD momentum (G = 4 MiB)": lambda: optimizer_step(lambda: SGD(0.1, momentum=0.9)),
    "optimizer step, Adam (G = 4 MiB)": lambda: optimizer_step(lambda: Adam(0.1)),
    "optimizer step, SGD momentum, sharded": lambda: optimizer_step(
        lambda: SGD(0.1, momentum=0.9, shard_state=True)
    ),
    "optimizer step, Adam, sharded": lambda: optimizer_step(lambda: Adam(0.1, shard_state=True)),
    "merge_call returning PerReplica (S = 1 MiB each)": merge_call_per_replica,
    "merge_call with array arguments (S = 1 MiB each)": merge_call_arguments,
    "broadcast_to (S = 1 MiB)": broadcast_to,
    "dataset step (shuffled ArrayDataset)": dataset_step,
}


def main() -> None:
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    for name, build in OPERATIONS.items():
        step = build()
        with Ledger.recording() as ledger:
            step()
        moved = WORLD.gather(ledger.moved)
        try:  # what a ring algorithm sends from this rank for these calls
            ring = f"{sum(ring_bytes(call, size) for call in ledger.log):,.0f} B"
        except ValueError:
            ring = "-"
        if rank == 0:
            others = max(moved[1:], default=0)
            print(
                f"{size} ranks | {name} | others {others:,} B | rank 0 {moved[0]:,} B | ring {ring}",
                flush=True,
            )


if __name__ == "__main__":
    main()
