"""The bad-input table of docs/reliability.md, one test per row, checked on every rank at 1-4 ranks.

An error row asserts that every rank raised the same type (a lone raise would strand the
others in the next collective); a behaviour row compares with a NumPy reference.
"""

import threading

import numpy as np
import pytest

import mpistrat
from mpistrat import (
    CommunicationOptions,
    ContextError,
    InvalidArgumentError,
    PerReplica,
    UnsupportedTypeError,
)
from tests.conftest import RankChecks, all_ranks_agree, raises_on_every_rank


def all_reduce(group, value, op="sum", **kwargs):
    return group.strategy.run(lambda: mpistrat.get_replica_context().all_reduce(op, value, **kwargs))


def all_gather(group, value, axis=0):
    return group.strategy.run(lambda: mpistrat.get_replica_context().all_gather(value, axis))


def merge_call(group, fn, args=()):
    return group.strategy.run(lambda: mpistrat.get_replica_context().merge_call(fn, args=args))


# -- values MPI cannot carry: UnsupportedTypeError naming the leaf ----------------------

UNSUPPORTED = {
    "string": "text",
    "None": None,
    "object array": np.array([1, "a"], dtype=object),
    "bool array": np.array([True, False]),
    "string array": np.array(["a", "b"]),
    "datetime64 array": np.array(["2024-01-01"], dtype="datetime64[D]"),
    "structured array": np.zeros(2, dtype=[("x", "f8"), ("y", "i4")]),
    "int beyond int64": 2**70,
    "masked array": np.ma.masked_array([1.0, 2.0], mask=[False, True]),
    "PerReplica leaf": PerReplica((1.0,)),
    "arbitrary object": object(),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_leaf(group, name):
    value = {"w": [np.ones(2), UNSUPPORTED[name]]}
    raises_on_every_rank(group.comm, UnsupportedTypeError, lambda: all_reduce(group, value), match="['w'][1]")


# -- arguments with the right type but an unusable value: InvalidArgumentError ---------

INVALID = {
    "reduce op 'max'": lambda g: all_reduce(g, 1.0, op="max"),
    "options that are a dict": lambda g: all_reduce(g, 1.0, options={"timeout_seconds": 1}),
    "all_gather of a scalar": lambda g: all_gather(g, np.float64(1.0)),
    "all_gather axis out of range": lambda g: all_gather(g, np.ones(2), axis=1),
    "all_gather axis that is a string": lambda g: all_gather(g, np.ones(2), axis="0"),
    "all_gather axis that is a bool": lambda g: all_gather(g, np.ones(2), axis=True),
    "reduce axis out of range": lambda g: g.strategy.reduce("sum", np.ones(2), axis=3),
    "reduce op 'max' with axis": lambda g: g.strategy.reduce("max", np.ones(2), axis=0),
    "PerReplica of the wrong length to run": lambda g: g.strategy.run(
        lambda x: x, args=(PerReplica(tuple(range(g.size + 1))),)
    ),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_argument(group, name):
    raises_on_every_rank(group.comm, InvalidArgumentError, lambda: INVALID[name](group))


@pytest.mark.parametrize(
    "kwargs",
    [{"timeout_seconds": 0}, {"timeout_seconds": "5"}, {"check": "yes"}, {"bytes_per_pack": -1}],
    ids=str,
)
def test_invalid_communication_options(kwargs):
    with pytest.raises(InvalidArgumentError):
        CommunicationOptions(**kwargs)


def test_strategy_over_something_that_is_not_a_communicator():
    with pytest.raises(UnsupportedTypeError, match="intracommunicator"):
        mpistrat.MPIStrategy("world")


# -- merge_call values that cannot travel ---------------------------------------------


def test_merge_call_argument_that_cannot_be_pickled(group):
    raises_on_every_rank(
        group.comm,
        UnsupportedTypeError,
        lambda: merge_call(group, lambda strategy, lock: None, args=(threading.Lock(),)),
        match="cannot be pickled to send to rank 0",
    )


def test_merge_fn_result_that_cannot_be_pickled(group):
    raises_on_every_rank(
        group.comm,
        UnsupportedTypeError,
        lambda: merge_call(group, lambda strategy: threading.Lock()),
        match="cannot be pickled",
    )


# -- calls in the wrong context: ContextError --------------------------------------------


def test_replica_method_in_cross_replica_context(group):
    ctx = mpistrat.ReplicaContext(group.strategy, group.rank)
    with group.strategy.scope():
        raises_on_every_rank(
            group.comm, ContextError, lambda: ctx.all_reduce("sum", 1.0), match="replica context"
        )


def test_cross_replica_method_in_replica_context(group):
    raises_on_every_rank(
        group.comm,
        ContextError,
        lambda: group.strategy.run(lambda: group.strategy.reduce("sum", 1.0)),
        match="merge_call",
    )


def test_nested_run(group):
    raises_on_every_rank(
        group.comm, ContextError, lambda: group.strategy.run(lambda: group.strategy.run(lambda: None))
    )


def test_replica_context_used_after_its_run(group):
    ctx = group.strategy.run(mpistrat.get_replica_context)
    raises_on_every_rank(group.comm, ContextError, lambda: ctx.all_reduce("sum", 1.0))


def test_communicating_in_run_inside_a_root_merge_fn(group):
    # strategy.run inside a root-mode merge_fn runs each replica in turn on rank 0: a collective there
    # would strand the other ranks, so it is refused on every rank.
    def communicate(strategy):
        return strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1.0))

    raises_on_every_rank(group.comm, ContextError, lambda: merge_call(group, communicate), match="merge_fn")


@pytest.mark.parametrize("method", ["run", "scope", "reduce", "gather"])
def test_use_after_experimental_finalize(group, method):
    strategy = mpistrat.MPIStrategy(group.comm)
    strategy.experimental_finalize()
    calls = {
        "run": lambda: strategy.run(lambda: None),
        "scope": lambda: strategy.scope().__enter__(),
        "reduce": lambda: strategy.reduce("sum", 1.0),
        "gather": lambda: strategy.gather(np.ones(1), axis=0),
    }
    raises_on_every_rank(group.comm, ContextError, calls[method], match="finalized")


# -- values that are fine: they pass through ---------------------------------------------


def test_nan_and_inf_pass_through_as_values(group):
    got = all_reduce(group, np.array([np.nan, np.inf, -np.inf, 1.0]))
    gathered = all_gather(group, np.array([np.nan, np.inf]))
    checks = RankChecks()
    checks.that(np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and got[3] == group.size)
    checks.that(np.isnan(gathered[::2]).all() and (gathered[1::2] == np.inf).all())
    checks.agree(group.comm, f"{got} {gathered}")


def test_zero_size_arrays(group):
    got = all_reduce(group, {"empty": np.ones((0, 3)), "one": np.ones(1)})
    # rank 0 contributes no rows; the others one row each
    rows = all_gather(group, np.full((0 if group.rank == 0 else 1, 3), float(group.rank)))
    expected = np.array([[float(r)] * 3 for r in range(1, group.size)]).reshape(-1, 3)
    ok = got["empty"].shape == (0, 3) and got["one"].tolist() == [group.size]
    all_ranks_agree(group.comm, ok and np.array_equal(rows, expected), f"{got} {rows}")


def test_empty_nests(group):
    all_ranks_agree(group.comm, all_reduce(group, {}) == {} and all_gather(group, []) == [])


def test_non_contiguous_views(group):
    base = np.arange(48.0).reshape(6, 8) + group.rank
    views = {"strided": base[::2, 1::3], "transposed": base.T, "fortran": np.asfortranarray(base)}
    got = all_reduce(group, views)
    total = sum(np.arange(48.0).reshape(6, 8) + r for r in range(group.size))
    reference = {"strided": total[::2, 1::3], "transposed": total.T, "fortran": total}
    checks = RankChecks()
    checks.that(all(np.array_equal(got[k], reference[k]) for k in views))
    gathered = all_gather(group, base.T[:, ::2], axis=1)
    checks.that(
        np.array_equal(
            gathered, np.concatenate([(base - group.rank + r).T[:, ::2] for r in range(group.size)], 1)
        )
    )
    checks.agree(group.comm, f"{got}")


def test_mixed_dtypes_and_python_numbers_in_one_nest(group):
    value = {"f32": np.ones(2, np.float32), "i8": np.int8(1), "int": 1, "float": 0.5, "c": 1j}
    got = all_reduce(group, value)
    n = group.size
    checks = RankChecks()
    checks.that(got["f32"].dtype == np.float32 and got["f32"].tolist() == [n, n])
    checks.that(got["i8"].dtype == np.int8 and int(got["i8"]) == n)
    checks.that(int(got["int"]) == n and float(got["float"]) == 0.5 * n and complex(got["c"]) == n * 1j)
    checks.agree(group.comm, f"{got}")


def test_non_native_byte_order_is_reduced_by_value(group):
    got = all_reduce(group, np.array([1.5, 2.0], dtype=">f8"))
    all_ranks_agree(group.comm, got.tolist() == [1.5 * group.size, 2.0 * group.size], f"{got}")


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_ndarray_subclass_comes_back_as_ndarray(group):
    got = all_reduce(group, np.matrix([[1.0, 2.0]]))
    all_ranks_agree(group.comm, type(got) is np.ndarray and got.tolist() == [[group.size, 2.0 * group.size]])


def test_mixed_numpy_and_cupy_in_one_nest(group):
    cupy = pytest.importorskip("cupy")
    try:
        device = cupy.ones(2)
    except Exception as exc:  # CuPy without a usable GPU
        pytest.skip(f"no GPU: {exc}")
    got = all_reduce(group, {"host": np.ones(2), "device": device})
    checks = RankChecks()
    checks.that(type(got["host"]) is np.ndarray and type(got["device"]) is cupy.ndarray)
    checks.that(
        got["host"].tolist() == [group.size] * 2 and cupy.asnumpy(got["device"]).tolist() == [group.size] * 2
    )
    checks.agree(group.comm, f"{got}")
