"""Ranks pass different shapes, structures, dtypes and reduce ops (and all_gather dims)."""

import numpy as np

import mpistrat

strategy = mpistrat.MPIStrategy()
rank = strategy.extended.rank


def all_reduce(op, value):
    return strategy.run(lambda: mpistrat.get_replica_context().all_reduce(op, value))


def all_gather(value):
    return strategy.run(lambda: mpistrat.get_replica_context().all_gather(value, axis=0))


CASES = {
    "shape": (lambda: all_reduce("sum", {"a": np.ones(2), "b": np.ones(4 if rank == 1 else 2)}), "['b']"),
    "structure": (lambda: all_reduce("sum", {"a": 1.0, ("c" if rank == 2 else "b"): 1.0}), "['b']"),
    "dtype": (
        lambda: all_reduce("sum", {"w": [np.ones(2, np.float32 if rank == 0 else np.float64)]}),
        "['w'][0]",
    ),
    "reduce op": (lambda: all_reduce("mean" if rank == 1 else "sum", np.ones(2)), "reduce_op"),
    "all_gather dims": (lambda: all_gather({"x": np.ones((rank + 1, 4 if rank == 1 else 3))}), "['x']"),
}

for name, (call, path) in CASES.items():
    try:
        call()
        print(f"rank {rank} case {name}: no error", flush=True)
    except mpistrat.CollectiveMismatchError as exc:
        ok = path in str(exc)
        print(f"rank {rank} case {name}: {'ok' if ok else 'bad message'}: {exc}", flush=True)

total = all_reduce("sum", np.full(2, rank + 1.0))  # the strategy still works, with the right values
assert total.tolist() == [6.0, 6.0], total
print(f"rank {rank} after: ok", flush=True)
