"""merge_call in both modes: "root" (gather, run on rank 0, scatter) and "every_rank".

The seed page's variable-update pattern and a TF1-style optimizer's ``_distributed_apply``
must give the same weights in both modes, equal to serial NumPy on the summed updates.
"""

import numpy as np
import pytest

import mpistrat
from mpistrat import (
    CollectiveMismatchError,
    CommunicationOptions,
    InvalidArgumentError,
    Mirrored,
    PerReplica,
    ReduceOp,
)
from tests.conftest import WORLD, all_ranks_agree, raises_on_every_rank

SHAPES = [(3, 2), (4,), ()]
LR, MOMENTUM, STEPS = 0.5, 0.9, 3

_STRATEGIES: dict = {}


def strategy_for(mode, check=None):
    key = (mode, check)
    if key not in _STRATEGIES:
        options = CommunicationOptions(check=check)
        _STRATEGIES[key] = mpistrat.MPIStrategy(WORLD, merge_call=mode, communication_options=options)
    return _STRATEGIES[key]


def local_update(rank, step, k):
    """Replica ``rank``'s update of leaf ``k`` at ``step``: small integers over 4, exact in float32."""
    shape = SHAPES[k]
    base = (np.arange(int(np.prod(shape))).reshape(shape) % 5 + step + k).astype(np.float32)
    return base * np.float32(rank + 1) / np.float32(4)


def summed_update(size, step, k):
    return sum(local_update(r, step, k).astype(np.float64) for r in range(size))


def serial_sgd(size):
    ws = [np.ones(s) for s in SHAPES]
    for step in range(STEPS):
        for k, w in enumerate(ws):
            w -= LR * summed_update(size, step, k)
    return ws


def serial_momentum(size):
    ws, vs = [np.ones(s) for s in SHAPES], [np.zeros(s) for s in SHAPES]
    for step in range(STEPS):
        for k in range(len(SHAPES)):
            vs[k] = MOMENTUM * vs[k] - LR * summed_update(size, step, k)
            ws[k] += vs[k]
    return ws


def seed_pattern_step(strategy, ws, step):
    """The seed page: pairs in replica context, merge_call, batch_reduce_to, update."""
    rank = strategy.extended.rank
    pairs = [(local_update(rank, step, k), w) for k, w in enumerate(ws)]

    def merge_fn(strategy, pairs):
        reduced = strategy.extended.batch_reduce_to(ReduceOp.SUM, pairs)
        for r, (_, w) in zip(reduced, pairs, strict=True):
            strategy.extended.update(w, lambda var, t: var.assign_sub(LR * t), args=(r,))

    strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn, args=(pairs,)))


class TF1Momentum:
    """A TF1-style optimizer: apply_gradients merge_calls ``_distributed_apply``, which creates
    its slots on first use (every_rank mode), reduces the gradients and updates with group=False."""

    def __init__(self, strategy, ws, create_slots_early):
        self.slots = {}
        if create_slots_early:  # root mode: merge_fn runs on rank 0 alone and cannot create variables
            with strategy.scope():
                self._create_slots(strategy, ws)

    def _create_slots(self, strategy, ws):
        for w in ws:
            if id(w) not in self.slots:
                with strategy.extended.colocate_vars_with(w):
                    self.slots[id(w)] = mpistrat.Variable(np.zeros(w.shape, np.float32), trainable=False)

    def apply_gradients(self, grads_and_vars):
        return mpistrat.get_replica_context().merge_call(self._distributed_apply, args=(grads_and_vars,))

    def _distributed_apply(self, distribution, grads_and_vars):
        self._create_slots(distribution, [v for _, v in grads_and_vars])
        reduced = distribution.extended.batch_reduce_to(ReduceOp.SUM, grads_and_vars)
        updates = []
        for grad, (_, var) in zip(reduced, grads_and_vars, strict=True):

            def apply(v, g, slot):
                slot.assign(MOMENTUM * slot.value() - LR * g)
                return v.assign_add(slot.value())

            updates.append(
                distribution.extended.update(var, apply, args=(grad, self.slots[id(var)]), group=False)
            )
        return updates


def make_weights(strategy):
    with strategy.scope():
        return [mpistrat.Variable(np.ones(s, np.float32), name=f"w{k}") for k, s in enumerate(SHAPES)]


def assert_weights(ws, want, what):
    got = [w.numpy() for w in ws]
    ok = all(np.allclose(g, r, rtol=1e-6) and g.dtype == np.float32 for g, r in zip(got, want, strict=True))
    all_ranks_agree(WORLD, ok, f"{what}: {got} != {want}")
    copies = WORLD.allgather([g.tobytes() for g in got])
    all_ranks_agree(WORLD, all(c == copies[0] for c in copies), f"{what}: copies differ between ranks")


@pytest.mark.parametrize("mode", ["root", "every_rank"])
def test_seed_update_pattern_matches_numpy_in_both_modes(mode):
    strategy = strategy_for(mode)
    ws = make_weights(strategy)
    for step in range(STEPS):
        seed_pattern_step(strategy, ws, step)
    assert_weights(ws, serial_sgd(WORLD.Get_size()), mode)


@pytest.mark.parametrize("mode", ["root", "every_rank"])
def test_tf1_style_distributed_apply_matches_numpy_in_both_modes(mode):
    strategy = strategy_for(mode)
    ws = make_weights(strategy)
    opt = TF1Momentum(strategy, ws, create_slots_early=mode == "root")
    rank = strategy.extended.rank
    for step in range(STEPS):
        grads = [local_update(rank, step, k) for k in range(len(ws))]
        out = strategy.run(lambda g=grads: opt.apply_gradients(list(zip(g, ws, strict=True))))
    assert_weights(ws, serial_momentum(WORLD.Get_size()), mode)
    # group=False: one tuple per update, holding this rank's copy
    all_ranks_agree(WORLD, all(isinstance(u, tuple) and len(u) == 1 for u in out), f"{out}")


def test_every_rank_merge_fn_sees_its_own_values_and_reduces_collectively():
    strategy = strategy_for("every_rank")
    rank, size = strategy.extended.rank, strategy.num_replicas_in_sync

    def merge_fn(strategy, x, label):
        local = strategy.experimental_local_results(x)
        total = strategy.reduce("sum", x, axis=None)
        return local, total, label, x

    local, total, label, own = strategy.run(
        lambda: mpistrat.get_replica_context().merge_call(merge_fn, args=(np.array([rank, 1.0]), "tag"))
    )
    ok = (
        len(local) == 1
        and local[0].tolist() == [rank, 1.0]
        and total.tolist() == [size * (size - 1) / 2, size]
        and label == "tag"
        and own.tolist() == [rank, 1.0]  # a PerReplica result is this replica's component
    )
    all_ranks_agree(WORLD, ok, f"{local} {total} {label} {own}")


def test_every_rank_merge_fn_error_on_one_rank_is_raised_on_every_rank():
    strategy = strategy_for("every_rank")
    rank = strategy.extended.rank

    def merge_fn(strategy):
        if rank == WORLD.Get_size() - 1:
            raise ValueError("bad value on the last rank")
        return 1

    message = raises_on_every_rank(
        WORLD,
        ValueError,
        lambda: strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn)),
        "bad value on the last rank",
    )
    assert message
    # the strategy still works: every rank is at the same collective count
    total = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1))
    all_ranks_agree(WORLD, int(total) == WORLD.Get_size(), f"{total}")


def test_strategy_refuses_unknown_merge_call_mode():
    with pytest.raises(InvalidArgumentError, match="merge_call must be 'root' or 'every_rank'"):
        mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF, merge_call="rank0")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("check", "caught"), [("strict", True), (True, False)])
def test_strict_check_catches_copies_that_drift(check, caught):
    """An update that differs between ranks (here rank-dependent noise) is caught by checksum,
    on every rank, naming the variable; the default check cannot see it."""
    strategy = strategy_for("every_rank", check)
    rank = strategy.extended.rank
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(3, np.float32), name="drifting")

    def merge_fn(strategy):
        strategy.extended.update(w, lambda v: v.assign_add(np.full(3, rank, np.float32)))

    def step():
        strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn))

    if caught:
        raises_on_every_rank(WORLD, CollectiveMismatchError, step, "'drifting'")
    else:
        step()
        drifted = WORLD.allgather(w.numpy().tolist())
        all_ranks_agree(WORLD, drifted[0] != drifted[-1], f"{drifted}")


def test_strict_check_passes_deterministic_optimizer_steps():
    strategy = strategy_for("root", "strict")
    ws = make_weights(strategy)
    opt = mpistrat.optimizers.SGD(LR)
    rank = strategy.extended.rank
    for step in range(STEPS):
        grads = [local_update(rank, step, k) for k in range(len(ws))]
        strategy.run(lambda g=grads: opt.apply_gradients(zip(g, ws, strict=True)))
    assert_weights(ws, serial_sgd(WORLD.Get_size()), "strict SGD")


@pytest.mark.mpi(min_size=2)
def test_every_rank_merge_fn_failing_before_a_collective_the_others_enter_does_not_hang():
    """The failing rank's closing handshake meets the others' reduce: every rank raises there, and
    nobody waits in a closing handshake that the failing rank has left. The others raise its
    ValueError, naming it and where they waited, not "ranks are in different collectives"."""
    strategy = strategy_for("every_rank")
    rank = strategy.extended.rank

    def merge_fn(strategy):
        if rank == 1:
            raise ValueError("boom on rank 1")
        return strategy.reduce("sum", np.ones(2), axis=None)

    message = raises_on_every_rank(
        WORLD,
        ValueError,
        lambda: strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn)),
        "boom on rank 1",
    )
    if rank != 1:
        assert "failed on rank 1, which left reduce" in message, message
    total = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1))
    all_ranks_agree(WORLD, int(total) == WORLD.Get_size(), f"{total}")


@pytest.mark.parametrize("mode", ["root", "every_rank"])
def test_results_give_each_replica_its_component_in_both_modes(mode):
    strategy = strategy_for(mode)
    rank, size = strategy.extended.rank, strategy.num_replicas_in_sync

    def merge_fn(strategy):
        return {"mine": PerReplica([10 * r for r in range(size)]), "same": Mirrored([7] * size)}

    got = strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn))
    all_ranks_agree(WORLD, got == {"mine": 10 * rank, "same": 7}, f"{mode}: {got}")


@pytest.mark.mpi(min_size=2)
def test_a_component_that_cannot_be_pickled_fails_every_rank():
    strategy = strategy_for("root")
    size = strategy.num_replicas_in_sync

    def merge_fn(strategy):
        return PerReplica([r if r != 1 else (lambda: 1) for r in range(size)])

    raises_on_every_rank(
        WORLD,
        mpistrat.UnsupportedTypeError,
        lambda: strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn)),
        "cannot be pickled",
    )


def test_strict_check_leaves_sync_on_read_copies_alone():
    """Sync-on-read copies differ by design: strict compares mirrored variables only."""
    strategy = strategy_for("every_rank", "strict")
    rank = strategy.extended.rank
    with strategy.scope():
        count = mpistrat.Variable(0.0, synchronization="ON_READ", aggregation="SUM", name="count")
    strategy.run(lambda: count.assign_add(float(rank + 1)))

    def merge_fn(strategy):
        strategy.extended.update(count, lambda v: v.assign_add(1.0))

    strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn))
    with strategy.scope():
        total = float(count.value())
    n = WORLD.Get_size()
    all_ranks_agree(WORLD, total == n * (n + 1) / 2 + n, f"{total}")


@pytest.mark.parametrize(
    ("what", "error"),
    [
        ("reduce", None),
        ("run", None),  # tf runs strategy.run inside merge_fn: once per replica, here on rank 0
        ("variable", mpistrat.ContextError),
        ("finalize", mpistrat.ContextError),
    ],
)
def test_scope_inside_a_root_merge_fn_keeps_the_merge_context(what, error):
    """merge_fn runs on rank 0 alone: entering the scope there must not turn its calls into
    collectives that rank 0 would enter alone (a hang), nor free the communicator."""
    strategy = strategy_for("root")
    size = strategy.num_replicas_in_sync

    def merge_fn(strategy, x):
        with strategy.scope():
            if what == "reduce":
                return strategy.reduce("sum", x, axis=None)
            if what == "run":
                return strategy.run(lambda: 1)
            if what == "variable":
                return mpistrat.Variable(1.0)
            return strategy.experimental_finalize()

    def call():
        return strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn, args=(np.ones(2),)))

    if error is None:
        got = call()
        want = [size, size] if what == "reduce" else 1
        all_ranks_agree(WORLD, np.asarray(got).tolist() == want, f"{got}")
    else:
        raises_on_every_rank(WORLD, error, call)
    total = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", 1))
    all_ranks_agree(WORLD, int(total) == size, f"{total}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["reduce", "reduce_to", "batch_reduce_to"])
@pytest.mark.parametrize("shapes", [((3,), (1,)), ((3, 1), (1, 3))], ids=["3-and-1", "column-and-row"])
def test_root_merge_reductions_refuse_replicas_of_different_shapes(how, shapes):
    """NumPy would broadcast (3,) with (1,), and (3, 1) with (1, 3): a wrong answer, not tf's error."""
    strategy = strategy_for("root")
    rank = strategy.extended.rank
    x = np.ones(shapes[0] if rank == 0 else shapes[1])

    def merge_fn(s, v):
        if how == "reduce":
            return s.reduce("SUM", v, axis=None)
        if how == "reduce_to":
            return s.extended.reduce_to("SUM", v, destinations="/cpu:0")
        return s.extended.batch_reduce_to("SUM", [(v, "/cpu:0")])

    raises_on_every_rank(
        WORLD,
        InvalidArgumentError,
        lambda: strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn, args=(x,))),
        "the replicas' values have different shapes",
    )
