"""Per-step paths scale like a ring or tree collective: counted per rank, at every size the suite runs.

Strategies here talk on a :class:`~tests.support.counting.CountingComm`, which logs every MPI call
and the bytes each rank hands to MPI or gets back. The ideal of each operation is
written from first principles (the bytes of one all-reduce of the gradients, one
component per rank, ...); anything that grew with the number of ranks would fail at
3 or 4 ranks. The values are checked against serial NumPy at the same time.
"""

import tracemalloc

import numpy as np
import pytest

import mpistrat
from mpistrat import CommunicationOptions, PerReplica
from mpistrat.optimizers import SGD, Adam
from tests.conftest import WORLD, RankChecks, all_ranks_agree
from tests.support.counting import CountingComm, Ledger, ring_bytes

HANDSHAKE = 104  # bytes of one handshake: thirteen int64 in one Allreduce(MAX)
SHAPES = [(64, 32), (32,), (32, 16), (16,), (128,), (8, 8, 4), (1,), (40, 20)] * 2  # 16 leaves
GRAD_BYTES = sum(int(np.prod(s)) for s in SHAPES) * 4  # float32


def _strategy(**kwargs):
    return mpistrat.MPIStrategy(CountingComm(WORLD), **kwargs)


_STRATEGIES: dict = {}


@pytest.fixture(scope="module")
def counted():
    if "root" not in _STRATEGIES:
        _STRATEGIES["root"] = _strategy()
    return _STRATEGIES["root"]


def _pattern(shape, k):
    return ((np.arange(np.prod(shape)).reshape(shape) + 3 * k) % 7 - 3).astype(np.float32) / 8


def _grads(rank):
    """Rank r's gradient of leaf k is (r + 1) * pattern_k: the sum over ranks is known exactly."""
    return [np.float32(rank + 1) * _pattern(s, k) for k, s in enumerate(SHAPES)]


def _summed(size):
    return [np.float32(size * (size + 1) / 2) * _pattern(s, k) for k, s in enumerate(SHAPES)]


def _reference(name, size, steps):
    """Serial NumPy: the optimizer's formulas on the summed gradient, in float64."""
    ws = [np.ones(s) for s in SHAPES]
    slots = [[np.zeros(s), np.zeros(s)] for s in SHAPES]
    lr, m = 0.1, 0.9
    for t in range(1, steps + 1):
        for w, g, (a, b) in zip(ws, _summed(size), slots, strict=True):
            g = g.astype(np.float64)
            if name == "momentum":
                a[...] = m * a - lr * g
                w += a
            else:
                a[...] = 0.9 * a + 0.1 * g
                b[...] = 0.999 * b + 0.001 * g * g
                w -= lr * np.sqrt(1 - 0.999**t) / (1 - 0.9**t) * a / (np.sqrt(b) + 1e-7)
    return ws


def _every_rank_the_same(value):
    values = WORLD.allgather(value)
    all_ranks_agree(WORLD, len(set(values)) == 1, f"differs between ranks: {values}")


@pytest.mark.parametrize("name", ["momentum", "adam"])
@pytest.mark.parametrize("bytes_per_pack", [0, 8 << 10])
def test_optimizer_step_is_one_allreduce_of_the_gradients(name, bytes_per_pack):
    """A step moves the bytes of one all-reduce of the gradients, at every R: no rank-0 funnel,
    no broadcast of variables or slots; bytes_per_pack splits it into packs."""
    options = CommunicationOptions(bytes_per_pack=bytes_per_pack)
    strategy = _strategy(communication_options=options)
    rank, size = strategy.extended.rank, strategy.num_replicas_in_sync
    with strategy.scope():
        ws = [mpistrat.Variable(np.ones(s, np.float32), name=f"w{k}") for k, s in enumerate(SHAPES)]
        opt = SGD(0.1, momentum=0.9) if name == "momentum" else Adam(0.1)
        opt.build(ws)
    grads = _grads(rank)
    step = lambda: opt.apply_gradients(zip(grads, ws, strict=True))  # noqa: E731
    strategy.run(step)
    with Ledger.recording() as ledger:
        strategy.run(step)
    strategy.experimental_finalize()

    packs = 1 if not bytes_per_pack else -(-GRAD_BYTES // bytes_per_pack)  # the flat buffer cut in packs
    handshakes = 1 + (size > 1)  # the opening one, and strategy.run's closing one (its results' structure)
    payload = ledger.only("Allreduce")
    ok = (
        ledger.names() == ["Allreduce"] * len(ledger.log)  # nothing but all-reduces: no Bcast, no gather
        and payload.calls == packs + handshakes
        and ledger.sent == GRAD_BYTES + handshakes * HANDSHAKE
        and ledger.sent <= 1.10 * GRAD_BYTES
    )
    all_ranks_agree(WORLD, ok, f"{size} ranks: {ledger.log}")
    _every_rank_the_same((ledger.calls, ledger.sent, ledger.received))
    want = _reference(name, size, steps=2)
    close = all(np.allclose(w.numpy(), r, rtol=1e-5, atol=1e-6) for w, r in zip(ws, want, strict=True))
    all_ranks_agree(WORLD, close, "weights differ from the serial NumPy reference")
    same = WORLD.allgather([w.numpy().tobytes() for w in ws])
    all_ranks_agree(WORLD, all(s == same[0] for s in same), "the copies differ between ranks")


def _optimizer(name, shard):
    return SGD(0.1, momentum=0.9, shard_state=shard) if name == "momentum" else Adam(0.1, shard_state=shard)


def _optimizer_step(name, bytes_per_pack, shard):
    """A strategy on a counting communicator, its variables, optimizer and one step's closure."""
    strategy = _strategy(communication_options=CommunicationOptions(bytes_per_pack=bytes_per_pack))
    rank = strategy.extended.rank
    with strategy.scope():
        ws = [mpistrat.Variable(np.ones(s, np.float32), name=f"w{k}") for k, s in enumerate(SHAPES)]
        opt = _optimizer(name, shard)
    grads = _grads(rank)
    return strategy, ws, opt, lambda: opt.apply_gradients(zip(grads, ws, strict=True))


@pytest.mark.parametrize("name", ["momentum", "adam"])
@pytest.mark.parametrize("bytes_per_pack", [0, 8 << 10])
def test_sharded_step_moves_what_the_all_reduce_moves(name, bytes_per_pack):
    """Sharded state: per pack one reduce-scatter of the gradients and one all-gather of the weights;
    each rank hands MPI the pack and gets back its 1/R (and the reverse), which a ring moves in the
    bytes of one all-reduce. The weights match the serial reference and the unsharded step's."""
    checks = RankChecks()
    strategy, ws, _, step = _optimizer_step(name, bytes_per_pack, shard=True)
    rank, size = strategy.extended.rank, strategy.num_replicas_in_sync
    strategy.run(step)
    with Ledger.recording() as ledger:
        strategy.run(step)
    plain_strategy, plain_ws, _, plain_step = _optimizer_step(name, bytes_per_pack, shard=False)
    plain_strategy.run(plain_step)
    with Ledger.recording() as plain:
        plain_strategy.run(plain_step)
    strategy.experimental_finalize()
    plain_strategy.experimental_finalize()

    count = GRAD_BYTES // 4
    pack = count if not bytes_per_pack else bytes_per_pack // 4  # elements
    per_rank = -(-pack // size)  # each rank's block of a pack, the pack padded to R blocks
    packs = -(-count // (per_rank * size))
    padded = packs * per_rank * size * 4  # bytes
    if size == 1:  # nothing to shard: the unsharded step
        checks.that(ledger.names() == plain.names() and ledger.sent == plain.sent)
    else:
        scatter, gather = ledger.only("Reduce_scatter_block"), ledger.only("Allgather")
        checks.that(
            ledger.names() == ["Allreduce"] + ["Reduce_scatter_block", "Allgather"] * packs + ["Allreduce"]
            and ledger.only("Allreduce").sent == 2 * HANDSHAKE
            and (scatter.sent, scatter.received) == (padded, padded // size)
            and (gather.sent, gather.received) == (padded // size, padded)
        )
        ring = sum(ring_bytes(c, size) for c in ledger.log)
        ideal = sum(ring_bytes(c, size) for c in plain.log)
        checks.that(ideal <= ring <= 1.10 * ideal)
    checks.agree(WORLD, f"{size} ranks: {ledger.log} against {plain.log}")
    _every_rank_the_same((ledger.calls, ledger.sent, ledger.received))
    want = _reference(name, size, steps=2)
    close = all(np.allclose(w.numpy(), r, rtol=1e-5, atol=1e-6) for w, r in zip(ws, want, strict=True))
    same = all(
        np.allclose(w.numpy(), p.numpy(), rtol=1e-6, atol=1e-7) for w, p in zip(ws, plain_ws, strict=True)
    )
    all_ranks_agree(WORLD, close and same, f"rank {rank}: the weights differ from the reference or unsharded")
    copies = WORLD.allgather([w.numpy().tobytes() for w in ws])
    all_ranks_agree(WORLD, all(c == copies[0] for c in copies), "the copies differ between ranks")


@pytest.mark.parametrize("name,slots", [("momentum", 1), ("adam", 2)])
@pytest.mark.parametrize("shard", [False, True])
def test_optimizer_state_per_rank_is_slots_over_r_plus_one_pack(name, slots, shard):
    """Memory NumPy allocates for the optimizer (tracemalloc, from before its slots exist to after a
    step): the slots of 1/R of the parameters sharded (all of them unsharded), one pack of gradient
    staging (reduced in place); the variables move into flat storage at no cost."""
    strategy = _strategy()
    size = strategy.num_replicas_in_sync
    shapes = [(256, 256), (1000,), (64, 64, 8)]  # float32: 256 KiB + 4 KB + 128 KiB
    count = sum(int(np.prod(s)) for s in shapes)
    tracemalloc.start()  # before the variables: their arrays' release counts when they move
    try:
        with strategy.scope():
            ws = [mpistrat.Variable(np.ones(s, np.float32), name=f"w{k}") for k, s in enumerate(shapes)]
            opt = _optimizer(name, shard)
        grads = [np.full(s, 0.5, np.float32) for s in shapes]
        strategy.extended.collectives.caches.clear()
        before = tracemalloc.get_traced_memory()[0]
        strategy.run(lambda: opt.apply_gradients(zip(grads, ws, strict=True)))
        strategy.extended.collectives.caches.clear()  # the strategy's pool of spare receive buffers
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    strategy.experimental_finalize()
    per_rank = -(-count // size) if shard and size > 1 else count  # elements whose slots this rank holds
    staging = per_rank * size if shard and size > 1 else count  # one pack of gradients (padded)
    ideal = 4 * (slots * per_rank + staging)
    ok = ideal <= held <= ideal + (64 << 10)  # Python objects: a few KiB, whatever R
    all_ranks_agree(WORLD, ok, f"{size} ranks, shard={shard}: held {held} bytes, ideal {ideal}")


@pytest.mark.parametrize("nbytes", [1 << 10, 1 << 18])  # inside the pickled message, and a raw transfer
def test_merge_call_per_replica_result_costs_each_rank_its_component(counted, nbytes):
    """Replica r receives component r alone (a scatter), not all R of them."""
    rank, size = counted.extended.rank, counted.num_replicas_in_sync
    n = nbytes // 8

    def merge_fn(strategy, x):
        return PerReplica([np.full(n, float(r)) for r in range(size)])

    with Ledger.recording() as ledger:
        got = counted.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn, args=(np.ones(1),)))
    all_ranks_agree(WORLD, np.array_equal(got, np.full(n, float(rank))), f"rank {rank} got {got[:3]}")
    overhead = 4096  # pickles, headers and handshakes: a constant, whatever R
    if rank == 0:
        ok = ledger.received < overhead * size  # small per-rank pickles of the arguments
    else:
        ok = nbytes <= ledger.received < nbytes + overhead and ledger.sent < overhead
    all_ranks_agree(WORLD, ok, f"rank {rank} of {size}: sent {ledger.sent}, received {ledger.received}")


def test_merge_call_arguments_reach_rank_0_collectively(counted):
    """Large arguments travel in one Gatherv, not R - 1 receives; every rank sends its own once."""
    rank, size = counted.extended.rank, counted.num_replicas_in_sync
    x = np.full(1 << 15, float(rank))  # 256 KiB

    def merge_fn(strategy, v):
        return sum(float(c[0]) for c in v.values)

    with Ledger.recording() as ledger:
        total = counted.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn, args=(x,)))
    names = ledger.names()
    checks = RankChecks()
    checks.that(total == size * (size - 1) / 2 and "Recv" not in names and "Send" not in names)
    if size > 1:
        checks.that(names.count("Gatherv") == 1)
        if rank == 0:
            checks.that(ledger.only("Gatherv").received == (size - 1) * x.nbytes)
        else:
            checks.that(ledger.only("Gatherv").sent == x.nbytes)
    checks.agree(WORLD, f"rank {rank}: total {total}, calls {ledger.log}")
    _every_rank_the_same(ledger.calls)


def test_broadcast_to_and_only_first_replica_are_one_bcast(counted):
    rank, size = counted.extended.rank, counted.num_replicas_in_sync
    x = np.arange(1000, dtype=np.float32) * (rank + 1)
    with counted.scope():
        v = mpistrat.Variable(np.zeros(1000, np.float32), aggregation="only_first_replica")
        with Ledger.recording() as ledger:
            got = counted.extended.broadcast_to(x, destinations=v)
    with Ledger.recording() as written:
        counted.run(lambda: v.assign(np.arange(1000, dtype=np.float32) * (rank + 1)))
    closing = ["Allreduce"] if size > 1 else []  # strategy.run's closing handshake
    for what, led, after in (("broadcast_to", ledger, []), ("ONLY_FIRST_REPLICA assign", written, closing)):
        bcast = led.only("Bcast")
        ok = (
            led.names() == ["Allreduce", "Bcast", *after]  # the handshake, then the data once
            and led.only("Allreduce").sent == HANDSHAKE * (1 + len(after))
            and (bcast.sent if rank == 0 else bcast.received) == x.nbytes
        )
        all_ranks_agree(WORLD, ok, f"{what}: {led.log}")
    want = np.arange(1000, dtype=np.float32)
    ok = np.array_equal(got, want) and np.array_equal(v.numpy(), want)
    all_ranks_agree(WORLD, ok, f"rank {rank}: {got[:3]}, {v.numpy()[:3]}")


@pytest.mark.parametrize("nest", [False, True])  # one array (its short path) and a one-leaf list
def test_uneven_all_gather_is_handshake_sizes_and_one_allgatherv(counted, nest):
    """Each rank receives the result once and sends its own rows once; besides, only the
    handshake (13 int64) and one int64 size per rank: no per-leaf or per-rank calls."""
    rank, size = counted.extended.rank, counted.num_replicas_in_sync
    x = np.ones((100 * (rank + 1), 8), np.float32)  # uneven rows: rank r has 100 (r + 1)
    result_bytes = 100 * 8 * 4 * size * (size + 1) // 2
    with Ledger.recording() as ledger:
        got = counted.extended.collectives.all_gather([x] if nest else x, 0)
    got = got[0] if nest else got
    handshake, sizes, data = ledger.log if len(ledger.log) == 3 else (None, None, None)
    ok = (
        got.shape == (result_bytes // 32, 8)
        and handshake is not None
        and (handshake.name, sizes.name) == ("Allreduce", "Allgather")
        and handshake.sent + handshake.received == 2 * 13 * 8
        and (sizes.sent, sizes.received) == (8, 8 * size)
        and data.name == ("Allgatherv" if size > 1 else "Allgather")  # one rank: equal counts
        and (data.sent, data.received) == (x.nbytes, result_bytes)
    )
    all_ranks_agree(WORLD, ok, f"rank {rank} of {size}: {ledger.log}")


@pytest.mark.parametrize("check", [True, False])
def test_run_closes_with_one_handshake_of_fixed_size(counted, check):
    """strategy.run compares its results' structures in one handshake: the same bytes at every R, none
    at one rank or with the check off; the results themselves never travel."""
    strategy = counted if check else _strategy(communication_options=CommunicationOptions(check=False))
    size = strategy.num_replicas_in_sync
    result = {"loss": np.float32(1.0), "metrics": [np.zeros(1000, np.float32), np.float32(2.0)]}
    with Ledger.recording() as ledger:
        for _ in range(3):
            strategy.run(lambda: result)
    closing = 3 if check and size > 1 else 0
    ok = ledger.names() == ["Allreduce"] * closing and ledger.sent == ledger.received == closing * HANDSHAKE
    all_ranks_agree(WORLD, ok, f"{size} ranks: {ledger.log}")
    if not check:
        strategy.experimental_finalize()
