"""What a read gives cannot change a variable: ``value()``, ``read_value()`` and ``np.asarray(v)``
are read-only (tf returns immutable tensors), ``numpy()`` is a writable copy.

An in-place change of a read value on one rank would otherwise change that rank's copy of a
mirrored variable (its value is a view of the optimizer's flat buffer) and leave the copies
silently different.
"""

import numpy as np
import pytest

import mpistrat
from tests.conftest import all_ranks_agree

READS = {
    "value": lambda v: v.value(),
    "read_value": lambda v: v.read_value(),
    "asarray": np.asarray,
    "slice": lambda v: v[1:],
}


def refuses_in_place_change(read):
    try:
        read += 1
    except ValueError as exc:
        return "read-only" in str(exc)
    return False


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_read_value_cannot_be_changed_in_place_after_a_step(group, dtype, shard):
    with group.strategy.scope():
        w = mpistrat.Variable(np.arange(3, dtype=dtype), name="w")
        opt = mpistrat.optimizers.SGD(0.5, shard_state=shard)
    grad = np.full(3, group.rank + 1, dtype)
    group.strategy.run(lambda: opt.apply_gradients([(grad, w)]))
    total = sum(r + 1 for r in range(group.size))
    want = np.arange(3, dtype=dtype) - dtype(0.5) * dtype(total)
    refused = {name: refuses_in_place_change(read(w)) for name, read in READS.items()}
    copy = w.numpy()
    copy += 100  # a copy of its own: writable, and the variable keeps its value
    group.strategy.run(lambda: opt.apply_gradients([(grad, w)]))  # a step after the reads still works
    want2 = want - dtype(0.5) * dtype(total)
    copies = group.comm.allgather(w.numpy())
    ok = all(refused.values()) and all(np.array_equal(c, want2) for c in copies) and w.dtype == dtype
    all_ranks_agree(group.comm, ok, f"refused {refused}; copies {copies}; want {want2}")


def test_reads_of_every_kind_of_variable_are_read_only(group):
    plain = mpistrat.Variable(np.zeros(2))
    with group.strategy.scope():
        mirrored = mpistrat.Variable(np.zeros(2))
        on_read = mpistrat.Variable(np.zeros(2), synchronization="on_read", aggregation="sum")
    reads = {"plain": plain.value(), "mirrored": mirrored.value()}
    reads["on_read, replica"] = group.strategy.run(lambda: on_read.value())
    refused = {name: refuses_in_place_change(read) for name, read in reads.items()}
    plain.assign_add(np.ones(2))  # a write after a read leaves what was read as it was, and works
    with group.strategy.scope():
        mirrored.assign_add(np.ones(2))
    ok = (
        all(refused.values())
        and reads["plain"].tolist() == [0, 0]
        and reads["mirrored"].tolist() == [0, 0]
        and plain.numpy().tolist() == [1, 1]
        and mirrored.numpy().tolist() == [1, 1]
    )
    all_ranks_agree(group.comm, ok, f"refused {refused}; {plain.numpy()} {mirrored.numpy()}")
