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


# Above the size whose results the collectives recycle (comm/packing.py's POOL_MIN_BYTES) in both dtypes.
LARGE = 40000


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_read_given_back_as_a_gradient_leaves_no_read_only_buffer_behind(group, dtype):
    # The variable's first array is its creation's broadcast result; the read marks it read-only and
    # the step's flat storage lets it go: the next broadcast of that size must not receive into it.
    with group.strategy.scope():
        w = mpistrat.Variable(np.full(LARGE, 2, dtype), name="w")
        opt = mpistrat.optimizers.SGD(0.25)
    group.strategy.run(lambda: opt.apply_gradients([(w.value(), w)]))  # weight decay written by hand
    with group.strategy.scope():
        fresh = mpistrat.Variable(np.full(LARGE, 3, dtype), name="fresh")
    want = dtype(2) - dtype(0.25) * dtype(2 * group.size)
    ok = np.all(w.numpy() == want) and np.all(fresh.numpy() == 3) and fresh.dtype == dtype
    all_ranks_agree(group.comm, bool(ok), f"w {w.numpy()[:2]} want {want}; fresh {fresh.numpy()[:2]}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_read_held_across_replica_writes_of_a_sum_variable_keeps_its_value(group, dtype):
    with group.strategy.scope():
        w = mpistrat.Variable(np.zeros(LARGE, dtype), aggregation="SUM", name="w")

    def step(i):
        held = w.value()
        w.assign(np.full(LARGE, i + 1, dtype))  # each replica's value summed: (i + 1) * size
        return held

    helds = [group.strategy.run(step, args=(i,)) for i in range(3)]
    seen = [float(h[0]) for h in helds] + [float(w.numpy()[0])]
    want = [0.0] + [float((i + 1) * group.size) for i in range(3)]
    ok = seen == want and all(np.all(h == h[0]) for h in helds)
    all_ranks_agree(group.comm, ok, f"held then final {seen}; want {want}")
