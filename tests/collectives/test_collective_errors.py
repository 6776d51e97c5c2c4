"""Bad input to the core collectives is an error on every rank, never a hang."""

import warnings

import numpy as np
import pytest

import mpistrat
from mpistrat import CollectiveMismatchError, InvalidArgumentError, UnsupportedTypeError
from tests.conftest import all_ranks_agree, raises_on_every_rank


def run_replica(group, fn):
    return lambda: group.strategy.run(lambda: fn(mpistrat.get_replica_context(), group.rank))


def test_all_gather_of_a_scalar_on_one_rank(group):
    def fn(ctx, rank):
        return ctx.all_gather(np.float32(1) if rank == group.size - 1 else np.ones(1, np.float32), axis=0)

    raises_on_every_rank(group.comm, InvalidArgumentError, run_replica(group, fn), match="rank >= 1")


def test_all_gather_with_a_disagreeing_non_axis_dim(group):
    if group.size < 2:
        pytest.skip("needs two replicas to disagree")

    def fn(ctx, rank):
        return ctx.all_gather({"x": np.zeros((rank + 1, 2 + rank % 2))}, axis=0)

    message = raises_on_every_rank(group.comm, CollectiveMismatchError, run_replica(group, fn), match="['x']")
    assert "shape (*, 2)" in message and "shape (*, 3)" in message


def test_all_gather_axis_out_of_range(group):
    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        run_replica(group, lambda ctx, r: ctx.all_gather(np.ones((2, 2)), axis=2)),
        match="axis 2",
    )


def test_all_reduce_of_an_object_on_one_rank(group):
    def fn(ctx, rank):
        return ctx.all_reduce("sum", {"a": "text" if rank == 0 else 1.0})

    raises_on_every_rank(group.comm, UnsupportedTypeError, run_replica(group, fn), match="['a']")


@pytest.mark.parametrize("bad", [np.array(["x"]), np.array([True]), np.array([object()], dtype=object)])
def test_all_reduce_refuses_non_numeric_dtypes(group, bad):
    raises_on_every_rank(
        group.comm, TypeError, run_replica(group, lambda ctx, r: ctx.all_reduce("sum", [bad])), match="dtype"
    )


def test_all_reduce_with_different_shapes(group):
    if group.size < 2:
        pytest.skip("needs two replicas to disagree")

    def fn(ctx, rank):
        return ctx.all_reduce("sum", {"w": np.ones(3), "b": np.ones(2 if rank == 1 else 1)})

    message = raises_on_every_rank(group.comm, CollectiveMismatchError, run_replica(group, fn), match="['b']")
    assert "rank 1" in message


def test_all_reduce_with_different_reduce_ops(group):
    if group.size < 2:
        pytest.skip("needs two replicas to disagree")
    fn = lambda ctx, rank: ctx.all_reduce("sum" if rank else "mean", np.ones(2))  # noqa: E731
    raises_on_every_rank(group.comm, CollectiveMismatchError, run_replica(group, fn), match="reduce_op")


def test_collectives_called_in_different_orders(group):
    if group.size < 2:
        pytest.skip("needs two replicas to disagree")

    def fn(ctx, rank):
        if rank == 0:
            return ctx.all_gather(np.ones(2), axis=0)
        return ctx.all_reduce("sum", np.ones(2))

    raises_on_every_rank(
        group.comm, CollectiveMismatchError, run_replica(group, fn), match="different collectives"
    )
    after = group.strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.ones(2)))
    all_ranks_agree(group.comm, np.array_equal(after, np.full(2, group.size)))


def test_unknown_reduce_op(group):
    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        run_replica(group, lambda ctx, r: ctx.all_reduce("max", 1.0)),
        match="'SUM', 'MEAN'",
    )


def test_inputs_are_never_modified(group):
    single = np.arange(4, dtype=np.float32)
    nest_in = {"a": np.arange(3.0), "b": [np.ones((2, 2), order="F"), np.arange(6)[::2]]}
    copies = (single.copy(), mpistrat.nest.map_structure(np.copy, nest_in))

    def fn(ctx, rank):
        ctx.all_reduce("mean", single)
        ctx.all_reduce("mean", nest_in)
        ctx.all_gather(nest_in["b"], axis=0)

    group.strategy.run(lambda: fn(mpistrat.get_replica_context(), group.rank))
    same = np.array_equal(single, copies[0]) and all(
        np.array_equal(x, y)
        for x, y in zip(mpistrat.nest.flatten(nest_in), mpistrat.nest.flatten(copies[1]), strict=True)
    )
    all_ranks_agree(group.comm, same)


def test_bytes_per_pack_splits_without_changing_results(group):
    options = mpistrat.CommunicationOptions(bytes_per_pack=16)
    values = [np.full(3, float(i)) for i in range(5)]

    got = group.strategy.run(
        lambda: mpistrat.get_replica_context().all_reduce("sum", values, options=options)
    )
    all_ranks_agree(
        group.comm, all(np.array_equal(g, v * group.size) for g, v in zip(got, values, strict=True))
    )


def test_check_disabled_still_reduces_correctly(group):
    options = mpistrat.CommunicationOptions(check=False)
    got = group.strategy.run(
        lambda: mpistrat.get_replica_context().all_reduce("mean", [1, np.ones(2)], options=options)
    )
    all_ranks_agree(group.comm, got[0] == 1.0 and np.array_equal(got[1], np.ones(2)))


def test_bytes_per_pack_that_differs_between_ranks_is_a_mismatch_not_an_mpi_error(group):
    """Different packs would hand MPI buffers of different sizes ("Message truncated")."""
    if group.size < 2:
        pytest.skip("needs two replicas to disagree")
    nest = [np.ones(64, np.float32) for _ in range(4)]

    def fn(ctx, rank):
        options = mpistrat.CommunicationOptions(bytes_per_pack=256 if rank == 0 else 0)
        return ctx.all_reduce("sum", nest, options)

    message = raises_on_every_rank(
        group.comm, CollectiveMismatchError, run_replica(group, fn), "bytes_per_pack"
    )
    assert "256" in message
    after = group.strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1))
    all_ranks_agree(group.comm, int(after) == group.size, f"{after}")


def test_shapes_whose_32_bit_fingerprints_collided_are_told_apart(group):
    """float64 arrays of shapes (12, 9, 8, 8, 1, 7) and (3, 6, 7, 10, 4) had the same CRC-32
    fingerprint, and MPI then failed on the different sizes."""
    if group.size < 2:
        pytest.skip("needs two replicas to disagree")
    shapes = [(12, 9, 8, 8, 1, 7), (3, 6, 7, 10, 4)]

    def fn(ctx, rank):
        return ctx.all_reduce("sum", np.ones(shapes[rank % 2]))

    raises_on_every_rank(group.comm, CollectiveMismatchError, run_replica(group, fn), "differ")


@pytest.mark.mpi(min_size=2)
def test_a_timeout_set_on_one_rank_only_changes_nothing(world, monkeypatch):
    """That rank polls its handshakes; the others must still meet it (MPI never matches a
    blocking collective with a non-blocking one)."""
    if world.rank == 0:
        monkeypatch.setenv("MPISTRAT_TIMEOUT", "60")
    strategy = mpistrat.MPIStrategy(world.comm)
    options = mpistrat.CommunicationOptions(timeout_seconds=60) if world.rank == 1 else None

    def step():
        ctx = mpistrat.get_replica_context()
        return ctx.all_reduce("sum", np.arange(3.0), options), ctx.all_gather(
            np.ones(1), axis=0, options=options
        )

    total, gathered = strategy.run(step)
    ok = total.tolist() == [0.0, world.size, 2.0 * world.size] and gathered.tolist() == [1.0] * world.size
    all_ranks_agree(world.comm, ok, f"{total} {gathered}")
    strategy.experimental_finalize()


@pytest.mark.mpi(min_size=2)
def test_a_bad_setting_on_one_rank_is_a_warning_there_and_the_default(world, monkeypatch):
    """It used to raise on that rank alone and leave the others waiting at strategy creation.
    Settings warn from rank 0 only unless MPISTRAT_LOG_ALL_RANKS is on, as here: the bad value is
    on the last rank alone (an MPMD launch)."""
    monkeypatch.setenv("MPISTRAT_LOG_ALL_RANKS", "1")
    bad = world.rank == world.size - 1
    if bad:
        monkeypatch.setenv("MPISTRAT_TIMEOUT", "abc")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = mpistrat.MPIStrategy(world.comm)
    said = any("MPISTRAT_TIMEOUT='abc' is not a number of seconds" in str(w.message) for w in caught)
    got = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", np.float32(1)))
    timeout = strategy.extended.collectives.monitor.env_timeout
    all_ranks_agree(world.comm, said == bad and got == world.size and timeout == 1800.0, f"{said} {got}")
    strategy.experimental_finalize()


def test_a_memmap_on_one_rank_takes_the_same_all_gather_path_as_arrays_elsewhere(group, tmp_path):
    """Large leaves are gathered in place; the choice must not depend on the array's exact type."""
    n = (1 << 20) // 4 + 7  # each leaf over the in-place threshold
    mine = [np.full(n, group.rank, np.float32), np.arange(n, dtype=np.float32) + group.rank]
    if group.rank == group.size - 1:
        path = tmp_path / f"leaf-{group.comm.Get_rank()}.npy"
        np.save(path, mine[0])
        mine[0] = np.load(path, mmap_mode="r")
    got = group.strategy.run(lambda: mpistrat.get_replica_context().all_gather(mine, axis=0))
    want = [np.concatenate([np.full(n, r, np.float32) for r in range(group.size)]),
            np.concatenate([np.arange(n, dtype=np.float32) + r for r in range(group.size)])]  # fmt: skip
    ok = all(np.array_equal(g, w) and g.dtype == np.float32 for g, w in zip(got, want, strict=True))
    all_ranks_agree(group.comm, ok, "all_gather with a memmap leaf differs from NumPy")
