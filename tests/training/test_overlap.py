"""``apply_gradients`` over a generator of pairs: each pack's sum starts while the rest come.

The generator yields the gradients last variable first, as a hand-written backward pass does.
The weights it trains are compared with the serial float64 NumPy reference of the flat
optimizers' tests and, bit for bit, with the same steps given as lists (on MPICH, and at 2 ranks
on any MPI: see :data:`SAME_ORDER`). By mechanism: a
recording communicator sees a non-blocking sum start before the generator yields its last
pair. Counted: a streamed step makes the list step's calls with its bytes. Wrong pairs on one
rank (fewer, twice, a bad shape, the generator raising) are an error on every rank, under a
timeout so that a hang would fail instead of stalling.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat
from mpistrat import CommunicationOptions, InvalidArgumentError, MpistratError
from mpistrat.collectives import progress
from mpistrat.optimizers import SGD, Adam
from mpistrat.training import overlap
from tests.conftest import WORLD, all_ranks_agree, raises_on_every_rank
from tests.support.counting import CountingComm, Ledger
from tests.training.test_flat_optimizers import (
    KINDS,
    NAMES,
    PACK,
    ROUNDING,
    STEPS,
    Reference,
    differences,
    local_grad,
    make_optimizer,
    make_variables,
    reference_after,
    reference_slots,
    same_bytes_on_every_rank,
    slots,
    summed_grad,
    weights,
)

TIMEOUT = 60.0  # seconds: a step that hangs raises CollectiveTimeoutError instead


@pytest.fixture(params=[0, PACK], ids=["one-pack", "packs"])
def strategy(group, request):
    made = mpistrat.MPIStrategy(
        group.comm,
        communication_options=CommunicationOptions(bytes_per_pack=request.param, timeout_seconds=TIMEOUT),
    )
    yield made
    made.experimental_finalize()


def backward(variables, t: int, rank: int, names=NAMES, events=None):
    """This rank's gradients of step ``t``, last variable first, each computed when asked for."""
    for name in reversed(names):
        grad = local_grad(name, t, rank)
        if events is not None:
            events.append(("yield", name))
        yield grad, variables[name]


def train(strategy, kind: str, shard: bool, rank: int, stream: bool, **options):
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make_optimizer(kind, shard) if not options else make_with(kind, shard, **options)
    for t in range(STEPS):
        if stream:
            strategy.run(lambda: opt.apply_gradients(backward(variables, t, rank)))  # noqa: B023
        else:
            pairs = [(local_grad(n, t, rank), variables[n]) for n in NAMES]
            strategy.run(lambda: opt.apply_gradients(pairs))  # noqa: B023
    return variables, opt


def make_with(kind: str, shard: bool, **options):
    cls = Adam if kind == "adam" else SGD
    return cls(0.1, shard_state=shard, **options)


def identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    return [n for n in a if a[n].dtype != b[n].dtype or a[n].tobytes() != b[n].tobytes()]


# MPICH's non-blocking sums add in the order of its blocking ones; Open MPI's (libnbc) and others may
# not from 3 ranks on (at 2, a + b is the same either way): there the two steps agree to rounding.
SAME_ORDER = MPI.Get_library_version().startswith("MPICH")


def like_the_list_step(got: dict[str, np.ndarray], listed: dict[str, np.ndarray], size: int) -> list[str]:
    if size <= 2 or SAME_ORDER:
        return [f"{n} differs from the list step" for n in identical(got, listed)]
    return differences(got, listed, ROUNDING)


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_generator_trains_as_numpy_and_as_the_list_bit_for_bit(group, strategy, kind, shard):
    streamed, opt = train(strategy, kind, shard, group.rank, stream=True)
    listed, list_opt = train(strategy, kind, shard, group.rank, stream=False)
    ref = reference_after(kind, group.size)
    got, got_slots = weights(streamed), slots(opt, streamed, kind)
    bad = differences(got, ref.params) + differences(got_slots, reference_slots(ref))
    bad += like_the_list_step(got, weights(listed), group.size)
    bad += like_the_list_step(got_slots, slots(list_opt, listed, kind), group.size)
    if int(opt.iterations.numpy()) != STEPS:
        bad.append(f"iterations {opt.iterations.numpy()}")
    if not same_bytes_on_every_rank(group.comm, {**got, **got_slots}):
        bad.append("the copies differ between ranks")
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_pairs_in_another_order_on_each_rank(group, strategy, shard):
    variables, opt = train(strategy, "adam", shard, group.rank, stream=False)
    listed, list_opt = train(strategy, "adam", shard, group.rank, stream=False)
    turn = group.rank % len(NAMES)
    order = NAMES[turn:] + NAMES[:turn]
    pairs = [(local_grad(n, STEPS, group.rank), listed[n]) for n in NAMES]
    strategy.run(lambda: list_opt.apply_gradients(pairs))
    strategy.run(lambda: opt.apply_gradients(backward(variables, STEPS, group.rank, order)))
    bad = like_the_list_step(weights(variables), weights(listed), group.size)
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


class Recording(CountingComm):
    """Notes, in :data:`EVENTS`, each non-blocking sum started (the handshake's MAX is not one)."""

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        if op == MPI.SUM:
            EVENTS.append(("start", "Iallreduce"))
        return super().Iallreduce(sendbuf, recvbuf, op)

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        EVENTS.append(("start", "Ireduce_scatter_block"))
        return super().Ireduce_scatter_block(sendbuf, recvbuf, op)


EVENTS: list[tuple[str, str]] = []


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_the_first_sum_starts_before_the_last_gradient_is_computed(shard):
    strategy = mpistrat.MPIStrategy(
        Recording(WORLD), communication_options=CommunicationOptions(bytes_per_pack=PACK)
    )
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make_optimizer("adam", shard)
    rank = WORLD.Get_rank()
    strategy.run(lambda: opt.apply_gradients(backward(variables, 0, rank)))  # builds (a list step)
    EVENTS.clear()
    strategy.run(lambda: opt.apply_gradients(backward(variables, 1, rank, events=EVENTS)))
    events = list(EVENTS)
    strategy.experimental_finalize()
    yields = [i for i, (what, _) in enumerate(events) if what == "yield"]
    starts = [i for i, (what, _) in enumerate(events) if what == "start"]
    ok = len(yields) == len(NAMES) and starts and starts[0] < yields[-1]
    all_ranks_agree(WORLD, bool(ok), f"events {events}")


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_calls_and_bytes_are_the_list_steps(shard):
    """Counted per rank: a streamed step makes the list step's MPI calls, each with the same bytes:
    one handshake and one sum per pack (sharded: and one all-gather per pack), at any R."""
    strategy = mpistrat.MPIStrategy(
        CountingComm(WORLD), communication_options=CommunicationOptions(bytes_per_pack=PACK)
    )
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make_optimizer("adam", shard)
    rank = WORLD.Get_rank()
    pairs = [(local_grad(n, 0, rank), variables[n]) for n in NAMES]
    strategy.run(lambda: opt.apply_gradients(pairs))
    with Ledger.recording() as listed:
        strategy.run(lambda: opt.apply_gradients(pairs))
    with Ledger.recording() as streamed:
        strategy.run(lambda: opt.apply_gradients(backward(variables, 1, rank)))
    packs = sum(g.layout.packs for g in opt._state.groups)

    def summary(ledger):
        return sorted((c.name, c.sent, c.received) for c in ledger.log)

    with Ledger.recording() as empty:  # strategy.run's own calls
        strategy.run(lambda: None)
    # the step's handshake and strategy.run's aside
    sums = streamed.only("Allreduce", "Reduce_scatter_block").calls - 1 - empty.calls
    strategy.experimental_finalize()
    ok = summary(streamed) == summary(listed) and sums == packs
    all_ranks_agree(WORLD, ok, f"streamed {summary(streamed)}, listed {summary(listed)}, {packs} packs")


def fewer(variables, t, rank):
    pairs = list(backward(variables, t, rank))
    yield from pairs[:-1] if rank == 0 else pairs


def twice(variables, t, rank):
    yield from backward(variables, t, rank)
    if rank == 0:
        yield local_grad("b", t, rank), variables["b"]


def bad_shape(variables, t, rank):
    for grad, var in backward(variables, t, rank):
        yield (np.zeros(7, np.float32) if rank == 0 and var.name == "b" else grad), var


class Broken(RuntimeError):
    pass


def raising(variables, t, rank):
    for i, pair in enumerate(backward(variables, t, rank)):
        if rank == 0 and i == 2:
            raise Broken("the backward pass failed")
        yield pair


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("wrong", [fewer, twice, bad_shape, raising], ids=lambda f: f.__name__)
def test_wrong_pairs_on_one_rank_raise_on_every_rank(world, wrong, shard):
    strategy = mpistrat.MPIStrategy(
        world.comm, communication_options=CommunicationOptions(bytes_per_pack=PACK, timeout_seconds=TIMEOUT)
    )
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make_optimizer("adam", shard)
    ref = Reference("adam")
    strategy.run(lambda: opt.apply_gradients(backward(variables, 0, world.rank)))
    ref.step({n: summed_grad(n, 0, world.size) for n in NAMES})
    error = Broken if wrong is raising else MpistratError  # the same type on every rank
    raises_on_every_rank(
        world.comm, error, lambda: strategy.run(lambda: opt.apply_gradients(wrong(variables, 1, world.rank)))
    )
    bad = differences(weights(variables), ref.params)
    strategy.run(lambda: opt.apply_gradients(backward(variables, 2, world.rank)))  # works after
    ref.step({n: summed_grad(n, 2, world.size) for n in NAMES})
    bad += differences(weights(variables), ref.params)
    if int(opt.iterations.numpy()) != 2:
        bad.append(f"iterations {opt.iterations.numpy()}")
    strategy.experimental_finalize()
    all_ranks_agree(world.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_a_variable_not_built_raises_on_every_rank_until_built(group, strategy, shard):
    """The first step (a list step) builds what it is given; a generator's later variable is an
    error on every rank naming the fix, and after ``build`` the generator trains them all."""
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make_optimizer("adam", shard)
    ref = Reference("adam")
    first = ["w", "s"]
    strategy.run(lambda: opt.apply_gradients(backward(variables, 0, group.rank, first)))
    ref.step({n: summed_grad(n, 0, group.size) for n in first})
    step = lambda: strategy.run(lambda: opt.apply_gradients(backward(variables, 1, group.rank)))  # noqa: E731
    raises_on_every_rank(group.comm, InvalidArgumentError, step, "optimizer.build")
    bad = differences(weights(variables), ref.params)
    with strategy.scope():
        opt.build(list(variables.values()))
    for t in (1, 2):
        strategy.run(lambda: opt.apply_gradients(backward(variables, t, group.rank)))  # noqa: B023
        ref.step({n: summed_grad(n, t, group.size) for n in NAMES})
    bad += differences(weights(variables), ref.params)
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize(
    "options",
    [
        {"communication_options": CommunicationOptions(deterministic=True)},
        {"communication_options": CommunicationOptions(compression="bf16")},
        {"gradient_accumulation_steps": 2},
    ],
    ids=["deterministic", "bf16", "accumulation"],
)
def test_modes_that_do_not_overlap_give_the_list_steps_bits(options):
    """Exact and compressed sums, and accumulation, take the list step (no non-blocking sum)."""
    strategy = mpistrat.MPIStrategy(
        Recording(WORLD), communication_options=CommunicationOptions(bytes_per_pack=PACK)
    )
    rank = WORLD.Get_rank()
    EVENTS.clear()
    streamed, _ = train(strategy, "adam", False, rank, stream=True, **options)
    started = len(EVENTS)
    listed, _ = train(strategy, "adam", False, rank, stream=False, **options)
    strategy.experimental_finalize()
    bad = identical(weights(streamed), weights(listed))
    all_ranks_agree(WORLD, not bad and not started, f"differ: {bad}; {started} non-blocking sums")


def test_a_zip_of_gradients_that_exist_is_the_list_step():
    """Only a generator streams: a zip (or a list) holds every gradient already, nothing to overlap."""
    strategy = mpistrat.MPIStrategy(
        Recording(WORLD), communication_options=CommunicationOptions(bytes_per_pack=PACK)
    )
    rank = WORLD.Get_rank()
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make_optimizer("adam", False)
    EVENTS.clear()
    for t in range(2):
        grads = [local_grad(n, t, rank) for n in NAMES]
        strategy.run(lambda: opt.apply_gradients(zip(grads, variables.values(), strict=True)))  # noqa: B023
    started = len(EVENTS)
    strategy.experimental_finalize()
    ref = Reference("adam")
    for t in range(2):
        ref.step({n: summed_grad(n, t, WORLD.Get_size()) for n in NAMES})
    bad = differences(weights(variables), ref.params)
    all_ranks_agree(WORLD, not bad and not started, f"{bad}; {started} non-blocking sums")


def shared_dir(group, tmp_path) -> str:
    return group.comm.bcast(str(tmp_path) if group.rank == 0 else None, root=0)


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_a_checkpoint_between_generator_steps_resumes_bit_for_bit(group, tmp_path, shard):
    """Save after two generator steps, restore into new variables and a new optimizer, go on with
    the generator (its sums non-blocking again): the bytes of a run never interrupted."""
    options = CommunicationOptions(bytes_per_pack=PACK)
    strategy = mpistrat.MPIStrategy(Recording(group.comm), communication_options=options)

    def fresh():
        variables = make_variables(strategy)
        with strategy.scope():
            return variables, make_optimizer("adam", shard)

    def generator_step(opt, variables, t):
        strategy.run(lambda: opt.apply_gradients(backward(variables, t, group.rank)))

    variables, opt = fresh()
    for t in range(4):
        generator_step(opt, variables, t)
    want = {**weights(variables), **slots(opt, variables, "adam")}
    variables, opt = fresh()
    checkpoint = mpistrat.Checkpoint(model=variables, opt=opt)
    for t in range(2):
        generator_step(opt, variables, t)
    path = checkpoint.save(f"{shared_dir(group, tmp_path)}/ckpt")
    variables, opt = fresh()
    mpistrat.Checkpoint(model=variables, opt=opt).restore(path).assert_consumed()
    EVENTS.clear()
    for t in (2, 3):
        generator_step(opt, variables, t)
    started = len(EVENTS)
    got = {**weights(variables), **slots(opt, variables, "adam")}
    strategy.experimental_finalize()
    bad = [n for n in want if got[n].tobytes() != want[n].tobytes()]
    all_ranks_agree(group.comm, not bad and started > 0, f"differ: {bad}; {started} non-blocking sums")


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_thousands_of_elements_per_pack_as_the_list_step(group, shard):
    """Packs of 16 KiB over layers of thousands of elements, where MPI's algorithms change with the
    size: the generator's weights are the list step's (bits where :data:`SAME_ORDER` holds)."""
    strategy = mpistrat.MPIStrategy(
        group.comm, communication_options=CommunicationOptions(bytes_per_pack=16384)
    )
    runs = []
    for stream in (True, False):
        with strategy.scope():
            variables = {
                f"l{i}": mpistrat.Variable(np.full(n, 0.5, np.float32), name=f"l{i}")
                for i, n in enumerate((5000, 3001, 2000, 7))
            }
            opt = Adam(0.01, shard_state=shard)
        for t in range(3):
            rng = np.random.default_rng([group.rank, t])
            grads = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in variables.items()}
            if stream:
                pairs = ((grads[n], variables[n]) for n in reversed(list(variables)))
                strategy.run(lambda: opt.apply_gradients(pairs))  # noqa: B023
            else:
                strategy.run(lambda: opt.apply_gradients([(grads[n], v) for n, v in variables.items()]))  # noqa: B023
        runs.append({n: v.numpy() for n, v in variables.items()})
    strategy.experimental_finalize()
    if group.size <= 2 or SAME_ORDER:
        bad = identical(*runs)
    else:
        bad = [n for n in runs[0] if not np.allclose(runs[0][n], runs[1][n], rtol=1e-6, atol=1e-7)]
    all_ranks_agree(group.comm, not bad, f"differ from the list step: {bad}")


# Layers of float32, 4.2 MB in all (uneven on purpose): without bytes_per_pack the generator step
# sums them in overlap.PIECES pieces, each of at least PIECE_BYTES.
LAYERS = [300_000, 7, 262_144, 500_001]


def layer_grad(k: int, t: int, rank: int) -> np.ndarray:
    return (((np.arange(LAYERS[k]) * (k + 3) + 11 * t + 5 * rank) % 17) - 8).astype(np.float32) / 8


def backward_layers(ws, t: int, rank: int):
    for k in reversed(range(len(ws))):
        EVENTS.append(("yield", str(k)))
        yield layer_grad(k, t, rank), ws[k]


def test_without_bytes_per_pack_a_generator_sums_in_pieces_while_it_runs():
    """The default: the list step sums one pack per dtype, the generator step PIECES pieces of it,
    the first started before the last gradient is yielded, moving the list step's bytes, per rank
    at any R. The weights are NumPy's, and the list step's (bit for bit at 2 ranks, to rounding
    beyond: the same sums, cut differently). (Sharded state keeps its packs: see the module.)"""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    strategy = mpistrat.MPIStrategy(Recording(WORLD))
    runs = {}
    ledgers = {}
    for stream in (False, True):
        with strategy.scope():
            ws = [mpistrat.Variable(np.zeros(n, np.float32), name=f"layer{k}") for k, n in enumerate(LAYERS)]
            opt = SGD(0.5)
        for t in range(3):
            EVENTS.clear()
            with Ledger.recording() as ledger:
                if stream and t:
                    grads = backward_layers(ws, t, rank)
                    strategy.run(lambda: opt.apply_gradients(grads))  # noqa: B023
                else:
                    pairs = [(layer_grad(k, t, rank), w) for k, w in enumerate(ws)]
                    strategy.run(lambda: opt.apply_gradients(pairs))  # noqa: B023
        events, ledgers[stream] = list(EVENTS), ledger
        with strategy.scope():
            runs[stream] = [w.numpy() for w in ws]
    strategy.experimental_finalize()
    bad = []
    want = [
        -0.5 * sum(layer_grad(k, t, r).astype(np.float64) for t in range(3) for r in range(size))
        for k in range(len(LAYERS))
    ]
    if not all(np.allclose(got, w, rtol=1e-6, atol=1e-6) for got, w in zip(runs[True], want, strict=True)):
        bad.append("the weights are not NumPy's")
    same = [np.array_equal(a, b) for a, b in zip(runs[True], runs[False], strict=True)]
    near = [np.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(runs[True], runs[False], strict=True)]
    if not all(same if size <= 2 else near):
        bad.append(f"the list step's weights differ: bitwise {same}, to rounding {near}")
    sum_calls = ("Allreduce", "Reduce_scatter_block")

    def sums(ledger):  # the data sums: not the handshakes' 13 int64
        return [c for c in ledger.only(*sum_calls).log if c.sent > 13 * 8]

    streamed, listed = sums(ledgers[True]), sums(ledgers[False])
    pieces = min(overlap.PIECES, sum(LAYERS) * 4 // overlap.PIECE_BYTES)
    if len(listed) != 1 or len(streamed) != pieces:
        bad.append(f"{len(streamed)} sums streamed, {len(listed)} listed; expected {pieces} and 1")
    if sum(c.sent for c in streamed) != sum(c.sent for c in listed):
        bad.append(f"bytes {sum(c.sent for c in streamed)} streamed, {sum(c.sent for c in listed)} listed")
    starts = [i for i, (what, _) in enumerate(events) if what == "start"]
    yields = [i for i, (what, _) in enumerate(events) if what == "yield"]
    if not (starts and yields and starts[0] < yields[-1]):
        bad.append(f"no sum started before the last gradient: {events}")
    all_ranks_agree(WORLD, not bad, "; ".join(bad))


def pumping() -> bool:
    return any(t.name == "mpistrat-progress" for t in threading.enumerate())


def spied_layers(ws, t: int, rank: int, seen: list[bool]):
    """``backward_layers``, noting before each yield whether the progress thread runs."""
    for pair in backward_layers(ws, t, rank):
        seen.append(pumping())
        yield pair


def pumped_steps(period: float, rank: int) -> tuple[list[np.ndarray], list[bool], bool, Ledger]:
    """Two generator steps after a building one, with the progress thread's ``period``: the weights,
    whether the thread ran before each yield and after the steps, the steps' calls."""
    saved, progress.PERIOD = progress.PERIOD, period
    try:
        strategy = mpistrat.MPIStrategy(CountingComm(WORLD))
        with strategy.scope():
            ws = [mpistrat.Variable(np.zeros(n, np.float32), name=f"layer{k}") for k, n in enumerate(LAYERS)]
            opt = SGD(0.5)
        pairs = [(layer_grad(k, 0, rank), w) for k, w in enumerate(ws)]
        strategy.run(lambda: opt.apply_gradients(pairs))  # builds
        seen: list[bool] = []
        with Ledger.recording() as ledger:
            for t in (1, 2):
                grads = spied_layers(ws, t, rank, seen)
                strategy.run(lambda: opt.apply_gradients(grads))  # noqa: B023
        after = pumping()
        with strategy.scope():
            got = [w.numpy() for w in ws]
        strategy.experimental_finalize()
    finally:
        progress.PERIOD = saved
    return got, seen, after, ledger


def test_the_progress_thread_runs_while_sums_are_in_flight_and_changes_nothing():
    """Default options, float32 layers of several pieces: where MPI has thread level MULTIPLE and
    there are 2+ ranks, a thread enters MPI's progress engine while sums are in flight and
    gradients still to come, and is gone once the step returns. The weights are serial NumPy's
    exactly (eighths: every sum is exact in float32), and the steps' calls and bytes per rank are
    the same with the thread and without: one sum per piece moving the parameters' bytes once,
    at any R."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    want = [
        np.float32(-0.5) * sum(layer_grad(k, t, r) for t in range(3) for r in range(size))
        for k in range(len(LAYERS))
    ]
    pieces = min(overlap.PIECES, sum(LAYERS) * 4 // overlap.PIECE_BYTES)
    threads = size > 1 and MPI.Query_thread() >= MPI.THREAD_MULTIPLE  # one rank's sums are done at once
    bad = []
    calls = {}
    if not progress.PERIOD > 0:
        bad.append(f"the thread is off by default (progress.PERIOD {progress.PERIOD})")
    for period in (0.0002, 0.0):
        got, seen, after, ledger = pumped_steps(period, rank)
        bad += [
            f"layer{k} is not NumPy's ({period})"
            for k in range(len(LAYERS))
            if got[k].dtype != np.float32 or not np.array_equal(got[k], want[k])  # (0.0 == -0.0)
        ]
        if any(seen) != (threads and period > 0) or after:
            bad.append(f"period {period}: the thread ran before the yields {seen}, after the steps {after}")
        calls[period] = sorted((c.name, c.sent, c.received) for c in ledger.log)
        data = [c for c in ledger.log if c.name == "Allreduce" and c.sent > 13 * 8]
        if len(data) != 2 * pieces or sum(c.sent for c in data) != 2 * 4 * sum(LAYERS):
            bad.append(
                f"period {period}: {len(data)} sums of {sum(c.sent for c in data)} B; expected {2 * pieces}"
            )
    if calls[0.0002] != calls[0.0]:
        bad.append(f"calls with the thread {calls[0.0002]}, without {calls[0.0]}")
    all_ranks_agree(WORLD, not bad, "; ".join(bad))
