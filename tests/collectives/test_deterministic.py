"""``CommunicationOptions(deterministic=True)``: exact sums, rounded once, the same bits everywhere.

References are independent of the code under test: Python's ``fractions.Fraction`` for the
exact sum with a correct rounding written out in integers, ``math.fsum`` per element, and
NumPy. Every rank can compute every rank's contributions (seeded by rank), so each checks
the whole result.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat
from mpistrat.collectives.exact_sum import exact_sum, format_of
from mpistrat.options import CommunicationOptions
from tests.conftest import WORLD, RankChecks, all_ranks_agree, raises_on_every_rank
from tests.support.counting import CountingComm, Ledger

pytestmark = pytest.mark.timeout(300)

EXACT = CommunicationOptions(deterministic=True)


def correctly_rounded(q: Fraction, dtype: np.dtype) -> float:
    """``q`` rounded to nearest even in ``dtype`` (overflow to inf), in Python integers."""
    fmt = format_of(np.dtype(dtype))
    assert fmt is not None
    if q == 0:
        return 0.0
    sign, q = (-1.0 if q < 0 else 1.0), abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    unit = max(e - (fmt.p - 1), fmt.emin_unit)
    scaled = q / Fraction(2) ** unit
    kept, rest = divmod(scaled.numerator, scaled.denominator)
    if 2 * rest > scaled.denominator or (2 * rest == scaled.denominator and kept % 2):
        kept += 1
    if kept.bit_length() + unit > np.finfo(dtype).maxexp:
        return sign * math.inf
    return sign * math.ldexp(kept, unit)


def contributions(
    rank: int, shape: tuple[int, ...], dtype: str = "float32", wide: bool = False
) -> np.ndarray:
    """One rank's values: magnitudes over many binades, cancelling between ranks."""
    rng = np.random.default_rng(1000 + rank)
    span = (-60, 60) if wide else (-12, 12)
    x = rng.uniform(1, 2, shape) * np.exp2(rng.integers(*span, shape)) * rng.choice([-1, 1], shape)
    big = rng.uniform(1e6, 2e6, shape) * (1 if rank % 2 == 0 else -1)  # large values that cancel
    return (x + big * (rank < 2)).astype(dtype)


def leaves_of(flat: np.ndarray, cuts: list[int]) -> list[np.ndarray]:
    return [part.reshape(2, -1) if part.size % 2 == 0 else part for part in np.split(flat, cuts)]


CUTS = [5, 17, 40, 41, 100, 230, 300]  # 8 leaves of one flat float32 vector of 500


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exact_and_identical_under_every_packing_split_and_rank_order(dtype):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    n = 500
    everyone = [contributions(r, (n,), dtype, wide=dtype == "float64") for r in range(size)]
    mine = everyone[rank]
    want = np.array(
        [correctly_rounded(sum(Fraction(float(x[j])) for x in everyone), dtype) for j in range(n)], dtype
    )
    fsum = np.array([math.fsum(float(x[j]) for x in everyone) for j in range(n)])
    reversed_comm = WORLD.Split(0, size - 1 - rank)
    strategies = {
        "world": mpistrat.MPIStrategy(WORLD),
        "reversed ranks": mpistrat.MPIStrategy(reversed_comm),
        "strategy-wide": mpistrat.MPIStrategy(WORLD, communication_options=EXACT),
    }
    results = {}
    for name, strategy in strategies.items():
        c = strategy.extended.collectives
        per_call = None if name == "strategy-wide" else EXACT
        for bpp in (0, 4 << 10, 64 << 10, 256):
            opts = CommunicationOptions(deterministic=per_call is not None or None, bytes_per_pack=bpp)
            one = c.all_reduce("sum", mine, opts)
            eight = np.concatenate([a.reshape(-1) for a in c.all_reduce("sum", leaves_of(mine, CUTS), opts)])
            results[(name, bpp, 1)], results[(name, bpp, 8)] = one, eight
    blobs = {key: r.tobytes() for key, r in results.items()}
    checks = RankChecks()
    checks.that(len(set(blobs.values())) == 1 and results[("world", 0, 1)].tobytes() == want.tobytes())
    got = results[("world", 0, 1)]
    ulps = np.abs(got.astype(np.float64) - fsum) / np.spacing(np.abs(got)).astype(np.float64)
    checks.that(bool((ulps <= 1).all()))
    checks.agree(WORLD, f"distinct results {len(set(blobs.values()))}, max ulps from fsum {ulps.max()}")
    everywhere = WORLD.allgather(got.tobytes())
    all_ranks_agree(WORLD, len(set(everywhere)) == 1, "ranks hold different bits")
    reversed_comm.Free()


@pytest.mark.mpi(min_size=1)
def test_mean_is_the_exact_quotient_rounded_once_and_integers_go_their_usual_way():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    everyone = [contributions(r, (64,), wide=True) for r in range(size)]
    c = mpistrat.MPIStrategy(WORLD).extended.collectives
    value = {"f": everyone[rank], "i": np.arange(5) + rank, "c": everyone[rank][:8].astype(np.complex64) * 1j}
    got = c.all_reduce("mean", value, EXACT)
    want = [
        correctly_rounded(sum(Fraction(float(x[j])) for x in everyone) / size, "float32") for j in range(64)
    ]
    checks = RankChecks()
    checks.that(got["f"].dtype == np.float32 and got["f"].tolist() == want)
    checks.that(np.array_equal(got["i"], (np.arange(5) * size + size * (size - 1) / 2) / size))
    checks.that(got["c"].real.tolist() == [0.0] * 8 and got["c"].imag.tolist() == want[:8])
    checks.agree(WORLD, f"{got}")


@pytest.mark.mpi(min_size=1)
def test_infinities_and_nans_give_the_ieee_answer_in_any_order():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x = np.array([1.0, np.inf if rank == 0 else 2.0, np.inf, np.nan if rank == size - 1 else 1.0, 3e38], "f4")
    if size > 1 and rank == 1:
        x[2] = -np.inf
    got = mpistrat.MPIStrategy(WORLD).extended.collectives.all_reduce("sum", x, EXACT)
    want = [
        float(size),
        math.inf,
        math.nan if size > 1 else math.inf,
        math.nan,
        math.inf if size > 1 else 3e38,
    ]
    ok = all((math.isnan(w) and math.isnan(g)) or g == np.float32(w) for g, w in zip(got, want, strict=True))
    all_ranks_agree(WORLD, ok, f"{got} != {want}")


def test_exact_sum_matches_correct_rounding_over_the_whole_exponent_range():
    rng = np.random.default_rng(7)
    for dtype, (lo, hi) in {"float32": (-149, 127), "float64": (-1074, 1023), "float16": (-24, 15)}.items():
        for trial in range(12):
            rows = int(rng.integers(1, 7))
            e = rng.integers(lo, hi, (rows, 40)).astype(float)
            x = (rng.uniform(1, 2, (rows, 40)) * np.exp2(e) * rng.choice([-1, 1], (rows, 40))).astype(dtype)
            if trial % 2:  # exact cancellation: the small contributions decide
                x = np.concatenate([x, -x[:1]])
            x[:, :2] = 0  # ties: 1 + half an ulp (to even), and just above it
            x[0, :2] = 1
            if x.shape[0] > 2:
                x[1, :2], x[2, 1] = 2.0 ** -format_of(np.dtype(dtype)).p, 2.0**-24
            want = [correctly_rounded(sum(Fraction(float(v)) for v in x[:, j]), dtype) for j in range(40)]
            got, _ = exact_sum(MPI.COMM_SELF, x, [])
            assert got.tolist() == want, (dtype, trial)
            mean, _ = exact_sum(MPI.COMM_SELF, x, [], divisor=3)
            assert mean.tolist() == [
                correctly_rounded(sum(Fraction(float(v)) for v in x[:, j]) / 3, dtype) for j in range(40)
            ], (dtype, trial)


def test_sums_in_one_limb_round_once_at_every_scale():
    """Contributions whose exponents are close (the common case) sum into one limb, which is
    rounded by a cast when it has at most 53 significant bits: checked against Fraction for
    normal values, float32 subnormals, sums that overflow to inf, and float64 sums of 54 bits
    (ties to even, which the cast cannot do exactly and the general rounding does)."""
    rng = np.random.default_rng(11)
    cases = {
        "float32": [(-3, 3), (-149, -140), (-130, -120), (120, 127)],
        "float16": [(-2, 2), (-24, -18), (12, 15)],
        "float64": [(-2, 2), (-1074, -1068), (1015, 1023)],
    }
    for dtype, spans in cases.items():
        for lo, hi in spans:
            rows = int(rng.integers(1, 5))
            e = rng.integers(lo, hi, (rows, 64)).astype(float)
            x = (rng.uniform(1, 2, (rows, 64)) * np.exp2(e) * rng.choice([-1, 1], (rows, 64))).astype(dtype)
            want = [correctly_rounded(sum(Fraction(float(v)) for v in x[:, j]), dtype) for j in range(64)]
            got, _ = exact_sum(MPI.COMM_SELF, x, [])
            assert got.tolist() == want, (dtype, lo, hi)
    ties = np.array([[1 + 2.0**-52, 1 + 2.0**-51], [1.5, 1.5]])  # 2.5 + 2**-52: a tie, to even (2.5)
    got, _ = exact_sum(MPI.COMM_SELF, ties, [])
    assert got.tolist() == [2.5, 2.5 + 2.0**-51]


def test_ties_round_to_even():
    x = np.array([[1, 1, 1 + 2**-23], [2.0**-24, 2.0**-24, 2.0**-24], [0, 2.0**-60, 0]], np.float32)
    got, _ = exact_sum(MPI.COMM_SELF, x, [])
    assert ((got - 1) / 2.0**-23).tolist() == [0.0, 1.0, 2.0]


def global_batch() -> np.ndarray:
    rng = np.random.default_rng(42)
    e = rng.integers(-20, 20, (37, 3, 2))
    return (rng.standard_normal((37, 3, 2)) * np.exp2(e) + 1e5 * rng.choice([-1, 1], (37, 1, 1))).astype("f4")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_strategy_reduce_along_an_axis_gives_the_same_bits_at_any_rank_count(op):
    """A fixed global batch split unevenly over the ranks: Strategy.reduce(op, batch, axis=0) with a
    deterministic strategy gives the 1-rank answer, the correctly rounded exact sum (or mean)."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    batch = global_batch()
    part = np.array_split(batch, [3 * r * r for r in range(1, size)])[rank]  # uneven, one may be empty
    strategy = mpistrat.MPIStrategy(WORLD, communication_options=EXACT)
    with strategy.scope():
        got = strategy.reduce(op, {"x": part, "n": np.ones(len(part))}, axis=0)
    alone = mpistrat.MPIStrategy(MPI.COMM_SELF).extended.collectives
    reference = alone.reduce_along_axis(op, {"x": batch, "n": np.ones(len(batch))}, 0, EXACT)
    divisor = len(batch) if op == "mean" else 1
    exact = [
        correctly_rounded(sum(Fraction(float(v)) for v in batch[:, i, j]) / divisor, "float32")
        for i in range(3)
        for j in range(2)
    ]
    checks = RankChecks()
    checks.that(got["x"].tobytes() == reference["x"].tobytes() and got["x"].reshape(-1).tolist() == exact)
    checks.that(float(got["n"]) == (1.0 if op == "mean" else 37.0) and got["x"].dtype == np.float32)
    checks.agree(WORLD, f"{got['x']} vs {reference['x']}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "mine, others",
    [
        (EXACT, None),
        (EXACT, CommunicationOptions(compression="bf16")),
        (None, CommunicationOptions(compression="fp16")),
    ],
)
def test_ranks_with_different_settings_raise_on_every_rank(mine, others):
    c = mpistrat.MPIStrategy(WORLD).extended.collectives
    opts = mine if WORLD.Get_rank() == 0 else others
    message = raises_on_every_rank(
        WORLD, mpistrat.CollectiveMismatchError, lambda: c.all_reduce("sum", [np.ones(3, "f4")], opts)
    )
    assert "deterministic" in message and "compression" in message, message
    assert c.all_reduce("sum", np.ones(2, "f4"), EXACT).tolist() == [WORLD.Get_size()] * 2  # still usable


@pytest.mark.mpi(min_size=2)
def test_an_optimizer_step_with_different_settings_raises_on_every_rank():
    strategy = mpistrat.MPIStrategy(WORLD)
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(4, "f4"))
        opts = EXACT if WORLD.Get_rank() == 0 else None
        opt = mpistrat.optimizers.SGD(0.1, communication_options=opts)
    raises_on_every_rank(
        WORLD,
        mpistrat.CollectiveMismatchError,
        lambda: strategy.run(lambda: opt.apply_gradients([(np.ones(4, "f4"), w)])),
        match="gradient reduction",
    )


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shard_state", [False, True])
def test_optimizers_sum_gradients_exactly(shard_state):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    everyone = [contributions(r, (24,)) for r in range(size)]
    results = []
    for comm in (WORLD, WORLD.Split(0, size - 1 - rank)):
        strategy = mpistrat.MPIStrategy(comm)
        with strategy.scope():
            w = mpistrat.Variable(np.zeros(24, "f4"))
            opt = mpistrat.optimizers.SGD(1.0, shard_state=shard_state, communication_options=EXACT)
        strategy.run(lambda w=w, opt=opt: opt.apply_gradients([(everyone[rank].copy(), w)]))
        results.append(w.numpy().copy())
    want = [-correctly_rounded(sum(Fraction(float(x[j])) for x in everyone), "float32") for j in range(24)]
    ok = results[0].tobytes() == results[1].tobytes() and results[0].tolist() == want
    all_ranks_agree(WORLD, ok, f"{results} vs {want}")


@pytest.mark.mpi(min_size=2)
def test_bytes_and_calls_against_the_plain_path():
    """Counting: the handshake, one MAX of 2 bytes per float32 element (+1), one SUM of the limbs:
    one int64 limb per element when the exponents span little, so 2.5x the plain bytes, at most 3x."""
    size = WORLD.Get_size()
    n = 4096
    x = (np.random.default_rng(WORLD.Get_rank()).uniform(1, 2, n) * 1e3).astype("f4")
    strategy = mpistrat.MPIStrategy(CountingComm(WORLD))
    c = strategy.extended.collectives
    with Ledger.recording() as plain:
        c.all_reduce("sum", x)
    with Ledger.recording() as exact:
        c.all_reduce("sum", x, EXACT)
    calls = [(call.name, call.sent) for call in exact.log]
    want_calls = [("Allreduce", 13 * 8), ("Allreduce", 2 * n + 1), ("Allreduce", 8 * n)]
    ratio = exact.sent / plain.sent
    ok = calls == want_calls and ratio <= 3 and plain.calls == 2
    all_ranks_agree(WORLD, ok, f"size {size}: calls {calls}, ratio {ratio:.2f}")
