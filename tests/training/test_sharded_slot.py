"""``ShardedSlot.assign`` takes the whole value, the same on every rank, and keeps this rank's part.

A value that differs between ranks would leave a slot that no rank's value describes (each rank
keeping its own part of its own value), so the ranks compare a checksum first, as a
cross-replica ``Variable.assign`` does, and all raise; a value of the wrong shape on one rank is
an error on every rank too. References: the NumPy arrays assigned.
"""

import numpy as np
import pytest

import mpistrat
from mpistrat import CollectiveMismatchError, InvalidArgumentError
from tests.conftest import all_ranks_agree, raises_on_every_rank


def sharded_slot(group, dtype):
    with group.strategy.scope():
        w = mpistrat.Variable(np.zeros((3, 5), dtype), name="w")
        opt = mpistrat.optimizers.SGD(0.1, momentum=0.9, shard_state=True)
    opt.build([w])
    return opt.get_slot(w, "momentum")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_same_value_on_every_rank_is_the_slot_everywhere(group, dtype):
    slot = sharded_slot(group, dtype)
    value = np.arange(15, dtype=dtype).reshape(3, 5) / 4
    slot.assign(value)
    with group.strategy.scope():
        got = slot.numpy()
    all_ranks_agree(group.comm, np.array_equal(got, value) and got.dtype == dtype, f"{got}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_value_that_differs_between_ranks_is_refused_and_nothing_written(group, dtype):
    slot = sharded_slot(group, dtype)
    before = np.full((3, 5), 2, dtype)
    slot.assign(before)
    mine = np.full((3, 5), group.rank, dtype)
    if group.size > 1:
        raises_on_every_rank(group.comm, CollectiveMismatchError, lambda: slot.assign(mine), "w/momentum")
        with group.strategy.scope():
            got = slot.numpy()
        all_ranks_agree(group.comm, np.array_equal(got, before), f"{got}")
    wrong = np.zeros((5, 3) if group.rank == group.size - 1 else (3, 5), dtype)
    raises_on_every_rank(group.comm, InvalidArgumentError, lambda: slot.assign(wrong), "shape (3, 5)")
