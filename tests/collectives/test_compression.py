"""``CommunicationOptions(compression="bf16" | "fp16")``: 16-bit values on the wire, float32 sums.

References: the rounding to 16 bits written out with ``math.frexp`` and Python's round-half-even,
``math.fsum`` for the sums, and the error bound of docs/concepts.md.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import mpistrat
from mpistrat.collectives import compressed
from mpistrat.options import CommunicationOptions
from tests.conftest import WORLD, RankChecks, all_ranks_agree, raises_on_every_rank
from tests.support.counting import CountingComm, Ledger, ring_bytes

pytestmark = pytest.mark.timeout(300)

CODECS = {"bf16": (8, -126), "fp16": (11, -14)}  # significand bits, smallest normal exponent


def rounded(x: float, codec: str) -> float:
    """``x`` rounded to nearest even with the codec's significand bits (exponent unbounded above)."""
    bits, emin = CODECS[codec]
    if x == 0 or not math.isfinite(x):
        return x
    _, e = math.frexp(abs(x))  # abs(x) in [2**(e-1), 2**e)
    unit = max(e - 1, emin) - (bits - 1)
    return round(x / 2.0**unit) * 2.0**unit  # round() is half-to-even


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_encoding_rounds_once_to_nearest_even(codec, dtype):
    rng = np.random.default_rng(3)
    lo, hi = (-130, 127) if codec == "bf16" else (-24, 15)
    x = (rng.uniform(1, 2, 3000) * np.exp2(rng.integers(lo, hi, 3000).astype(float))).astype(dtype)
    x[:8] = [1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 0, -0.0, 2.0**-20, 1 + 2.0**-30]
    x *= rng.choice([-1, 1], x.size)
    got = compressed.decode(compressed.encode(x, codec), codec).astype(np.float64)
    want = np.array([rounded(float(v), codec) for v in x])
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:5]
    special = np.array([np.inf, -np.inf, np.nan], dtype)
    assert np.array_equal(
        compressed.decode(compressed.encode(special, codec), codec), special, equal_nan=True
    )


def error_bound(parts: list[np.ndarray], codec: str, mean: bool) -> np.ndarray:
    """docs/concepts.md: |result - exact| <= (2u + (R + 1) 2**-24)(1 + u) sum|x_r| + (R + 1) eta."""
    u = compressed.unit_roundoff(codec)
    eta = 2.0**-134 if codec == "bf16" else 2.0**-25
    size = len(parts)
    magnitude = np.sum([np.abs(p.astype(np.float64)) for p in parts], axis=0) / (size if mean else 1)
    return (2 * u + (size + 1) * 2.0**-24) * (1 + u) * magnitude + (size + 1) * eta


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("codec", ["bf16", "fp16"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_sums_are_within_the_bound_and_other_leaves_are_exact(codec, op):
    checks = RankChecks()
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    parts = [np.random.default_rng(r).standard_normal(1001).astype("f4") * 10 for r in range(size)]
    doubles = [p.astype("f8") / 3 for p in parts]
    c = mpistrat.MPIStrategy(WORLD).extended.collectives
    value = {"f32": parts[rank], "f64": doubles[rank], "i": np.arange(3) + rank, "c": parts[rank][:4] * 1j}
    got = c.all_reduce(op, value, CommunicationOptions(compression=codec))
    detail = ""
    for key, each in (("f32", parts), ("f64", doubles)):
        exact = np.array([math.fsum(float(p[j]) for p in each) for j in range(1001)]) / (
            size if op == "mean" else 1
        )
        err = np.abs(got[key].astype(np.float64) - exact)
        checks.that(
            got[key].dtype == each[0].dtype and bool((err <= error_bound(each, codec, op == "mean")).all())
        )
        detail += (
            f"{key}: worst {float((err / error_bound(each, codec, op == 'mean')).max()):.2f} of the bound; "
        )
    plain = c.all_reduce(op, {"i": value["i"], "c": value["c"]})
    checks.that(np.array_equal(got["i"], plain["i"]) and np.array_equal(got["c"], plain["c"]))
    checks.that(len(set(WORLD.allgather(got["f32"].tobytes()))) == 1)
    checks.agree(WORLD, detail)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("where", ["input", "sum"])
def test_fp16_overflow_is_an_error_on_every_rank(where):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x = np.ones(10, "f4")
    if where == "input" and rank == size - 1:
        x[7] = 70000.0
    if where == "sum":
        x[:] = 65000.0 if size > 1 else 70000.0
    c = mpistrat.MPIStrategy(WORLD).extended.collectives
    raises_on_every_rank(
        WORLD,
        mpistrat.InvalidArgumentError,
        lambda: c.all_reduce("sum", x, CommunicationOptions(compression="fp16")),
        match="65504",
    )
    inf = np.array([np.inf, 1.0], "f4")  # an infinity in the input is carried, not an error
    assert c.all_reduce("sum", inf, CommunicationOptions(compression="fp16"))[0] == np.inf


BF16_MAX = 2.0**128 - 2.0**120  # bf16's largest finite value: (2 - 2**-7) * 2**127
_WORLD: list[mpistrat.MPIStrategy] = []


def world_strategy() -> mpistrat.MPIStrategy:
    """One strategy over the world for the overflow tests (creating one is collective)."""
    if not _WORLD:
        _WORLD.append(mpistrat.MPIStrategy(WORLD))
    return _WORLD[0]


def beyond_bf16(where: str, dtype: str) -> np.ndarray:
    """Each rank's values, finite and within float32's range, whose bf16 sum is not finite."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x = np.ones(10, dtype)
    if where == "input" and rank == size - 1:
        x[7] = 1e300 if dtype == "f8" else 3.4e38  # 3.4e38 < FLT_MAX
    elif where == "float32 sum" and rank < 2:  # two bf16 values whose float32 sum is infinite
        x[3] = BF16_MAX if size > 1 else np.finfo(np.float32).max
    elif where == "rounded sum" and rank < 2:  # a finite float32 sum, halfway past BF16_MAX: rounds up
        x[3] = (BF16_MAX, 2.0**119)[rank] if size > 1 else BF16_MAX + 2.0**119
    return x


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "where,dtype", [("input", "f8"), ("input", "f4"), ("float32 sum", "f4"), ("rounded sum", "f4")]
)
def test_bf16_overflow_is_an_error_on_every_rank(where, dtype):
    """A finite value or block sum beyond bf16's range is raised on every rank, as fp16's overflow
    is, instead of coming back as an infinity; an infinity in the input is carried."""
    c = world_strategy().extended.collectives
    opts = CommunicationOptions(compression="bf16")
    x = beyond_bf16(where, dtype)
    raises_on_every_rank(
        WORLD, mpistrat.InvalidArgumentError, lambda: c.all_reduce("sum", x, opts), match="bf16"
    )
    carried = np.array([np.inf, -np.inf, np.nan, 1.0], dtype)
    got = c.all_reduce("sum", carried, opts)
    ok = got[0] == np.inf and got[1] == -np.inf and np.isnan(got[2]) and got[3] == WORLD.Get_size()
    all_ranks_agree(WORLD, ok, f"{got}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("where", ["input", "rounded sum"])
def test_bf16_overflow_in_an_optimizer_step_is_an_error_on_every_rank(shard, where):
    strategy = world_strategy()
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(10, "f4"))
        opt = mpistrat.optimizers.SGD(
            1.0, shard_state=shard, communication_options=CommunicationOptions(compression="bf16")
        )
    grad = beyond_bf16(where, "f4")
    raises_on_every_rank(
        WORLD,
        mpistrat.InvalidArgumentError,
        lambda: strategy.run(lambda: opt.apply_gradients([(grad, w)])),
        match="bf16",
    )
    with strategy.scope():
        all_ranks_agree(WORLD, not w.numpy().any(), f"{w.numpy()}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", ["bf16", "fp16"])
def test_bytes_per_rank_are_at_most_055_of_the_plain_path(codec):
    """Bytes leaving each rank, by the ring model: Allreduce 2n(R-1)/R; Alltoall and Allgather
    (R-1)/R of the 16-bit data each. Calls: the handshake, one Alltoall, one Allgather."""
    size = WORLD.Get_size()
    x = np.random.default_rng(WORLD.Get_rank()).standard_normal(4096).astype("f4")
    c = mpistrat.MPIStrategy(CountingComm(WORLD)).extended.collectives
    with Ledger.recording() as plain:
        c.all_reduce("sum", x)
    with Ledger.recording() as small:
        c.all_reduce("sum", x, CommunicationOptions(compression=codec))

    def leaving(ledger: Ledger) -> float:
        return sum(ring_bytes(call, size) for call in ledger.log[1:])  # the handshake aside

    ratio = leaving(small) / leaving(plain)
    names = small.names()
    ok = names == ["Allreduce", "Alltoall", "Allgather"] and ratio <= 0.55
    all_ranks_agree(WORLD, ok, f"size {size}: {names}, ratio {ratio:.3f}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shard_state", [False, True])
def test_optimizers_take_the_option_for_their_gradients(shard_state):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    grads = [np.random.default_rng(r).standard_normal(50).astype("f4") for r in range(size)]
    strategy = mpistrat.MPIStrategy(WORLD)
    opts = CommunicationOptions(compression="bf16")
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(50, "f4"))
        opt = mpistrat.optimizers.SGD(1.0, shard_state=shard_state, communication_options=opts)
    strategy.run(lambda: opt.apply_gradients([(grads[rank].copy(), w)]))
    exact = -np.array([math.fsum(float(g[j]) for g in grads) for j in range(50)])
    checks = RankChecks()
    checks.that(bool((np.abs(w.numpy() - exact) <= error_bound(grads, "bf16", False)).all()))
    checks.that(len(set(WORLD.allgather(w.numpy().tobytes()))) == 1)
    checks.agree(WORLD, f"{w.numpy()[:4]} vs {exact[:4]}")


def test_options_are_validated():
    for bad, expected in (
        ({"compression": "int8"}, "compression must be one of 'none', 'bf16', 'fp16' or None; got 'int8'"),
        ({"compression": 16}, "got 16"),
        ({"deterministic": 1}, "deterministic must be True, False or None; got 1"),
        ({"deterministic": True, "compression": "bf16"}, "cannot be combined"),
    ):
        with pytest.raises(mpistrat.InvalidArgumentError, match=expected):
            CommunicationOptions(**bad)
    assert CommunicationOptions(compression="BF16").compression == "bf16"
    wide = CommunicationOptions(compression="fp16")
    assert wide.merge(CommunicationOptions(deterministic=True)).reduction == "deterministic"
    assert wide.merge(CommunicationOptions(compression="none")).reduction == ""
    assert (
        CommunicationOptions(deterministic=True).merge(CommunicationOptions(deterministic=False)).reduction
        == ""
    )
    with pytest.raises(mpistrat.InvalidArgumentError, match="communication_options must be"):
        mpistrat.optimizers.SGD(0.1, communication_options="bf16")
