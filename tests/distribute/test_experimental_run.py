"""Strategy.experimental_run (the Strategy seed page): fn gets this rank's part of the next input."""

import math

import numpy as np

from tests.conftest import all_ranks_agree


def test_each_replica_gets_its_part_of_each_global_batch(group):
    strategy, n, rank = group.strategy, group.size, group.rank
    batches = [np.arange(i, min(i + 4, 10)) for i in range(0, 10, 4)]  # range(10) in batches of 4
    iterator = strategy.make_dataset_iterator(batches)
    assert iterator.initialize() == []
    for batch in batches:
        k = math.ceil(len(batch) / n)  # tf.distribute's split: ceil(b / R) per replica, in rank order
        want = batch[rank * k : (rank + 1) * k]
        got = strategy.experimental_run(lambda x: x * 10, iterator)
        all_ranks_agree(group.comm, np.array_equal(got, want * 10), f"got {got}, want {want * 10}")


def test_without_an_iterator_fn_takes_no_arguments(group):
    got = group.strategy.experimental_run(lambda: 7)
    all_ranks_agree(group.comm, got == 7, f"got {got}")
