"""merge_call's object transfer: small arrays ride inside the pickled message, large ones
travel as raw bytes, and a call may mix both (ranks decide independently)."""

import numpy as np
import pytest

import mpistrat
from mpistrat.collectives.objects import INLINE_BYTES as _INLINE_BYTES
from tests.conftest import all_ranks_agree


def _local(rank, big):
    n = (_INLINE_BYTES // 8 + 10) if big else 3
    return {"x": np.arange(n, dtype=np.float64) + 1000 * rank, "tag": f"r{rank}", "i": np.int32(rank)}


@pytest.mark.parametrize("pattern", ["small", "large", "mixed"])
def test_merge_call_gathers_and_broadcasts_small_and_large_arrays(group, pattern):
    def big(r):
        return pattern == "large" or (pattern == "mixed" and r % 2 == 1)

    def merge_fn(strategy, value):
        parts = strategy.experimental_local_results(value["x"])
        tags = strategy.experimental_local_results(value["tag"])
        # a large result (every rank's values side by side) and a per-replica one
        whole = np.concatenate([np.asarray(p) for p in parts])
        return whole, list(tags), mpistrat.PerReplica(tuple(np.asarray(p)[:2] * 2 for p in parts))

    def step():
        return mpistrat.get_replica_context().merge_call(
            merge_fn, args=(_local(group.rank, big(group.rank)),)
        )

    whole, tags, mine = group.strategy.run(step)
    want = np.concatenate([_local(r, big(r))["x"] for r in range(group.size)])
    ok = (
        np.array_equal(whole, want)
        and whole.flags.writeable
        and tags == [f"r{r}" for r in range(group.size)]
        and np.array_equal(mine, (np.arange(2) + 1000 * group.rank) * 2)
    )
    all_ranks_agree(group.comm, ok, f"{whole[:4]} {tags} {mine}")


class _TwoArgumentError(Exception):
    """Pickles, but does not unpickle: its __init__ takes two arguments and args holds one."""

    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")


def test_values_that_pickle_but_do_not_unpickle_fail_every_rank(group):
    from tests.conftest import raises_on_every_rank

    collectives = group.strategy.extended.collectives

    def result():  # returned, not raised, by rank 0's work
        return collectives.on_root(lambda: _TwoArgumentError(3, "x"), kind="example")

    def arguments():
        return group.strategy.run(
            lambda: mpistrat.get_replica_context().merge_call(
                lambda s, e: 0, args=(_TwoArgumentError(group.rank, "x"),)
            )
        )

    raises_on_every_rank(group.comm, mpistrat.UnsupportedTypeError, result, "cannot be pickled")
    raises_on_every_rank(group.comm, mpistrat.UnsupportedTypeError, arguments, "cannot be pickled")
    after = group.strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1))
    all_ranks_agree(group.comm, int(after) == group.size, f"{after}")
