"""The keepers of a sharded optimizer's parts (``training/shard_copies.py``), without MPI: which survivor
holds each part after a death, and a replica's replayed update against the partner's own.

The jobs that kill ranks are in ``tests/distribute/test_recovery.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpistrat
from mpistrat import CommunicationOptions
from mpistrat.diagnostics import ulfm
from mpistrat.errors import PeerFailedError
from mpistrat.optimizers import SGD, Adagrad, Adam, AdamW, Lamb, LossScaleOptimizer, RMSprop
from mpistrat.training import pack_step, shard_copies
from mpistrat.training.optimizer_state import FlatState
from mpistrat.training.shard_copies import Facts
from mpistrat.training.variables import Variable
from tests.conftest import WORLD, RankChecks, all_ranks_agree
from tests.support.counting import CountingComm, Ledger


def facts(
    rank: int,
    steps: int = 5,
    dirty: bool = False,
    version: int = 5,
    pending: int = -1,
    size: int = 4,
    skipped: bool = False,
):
    return Facts(steps, dirty, rank, size, 1, version, pending, skipped)


def test_every_part_of_a_clean_state_is_its_owners():
    found = [facts(r) for r in range(4)]
    assert shard_copies._providers(found, 5) == {r: (r, "own") for r in range(4)}


def test_a_lost_part_comes_from_its_keeper_at_the_step_or_replayed_one_step_on():
    found = [facts(0), facts(1), facts(3)]  # rank 2 lost: its keeper is rank 3, now the survivors' 2
    assert shard_copies._providers(found, 5)[2] == (2, "replica")
    found = [facts(0, steps=6), facts(1, steps=6), facts(3, dirty=True, version=5, pending=6)]
    assert shard_copies._providers(found, 6)[2] == (2, "replay")


def test_a_part_updated_in_a_step_no_survivor_completed_is_taken_back():
    found = [facts(0, dirty=True), facts(1), facts(2, dirty=True), facts(3)]
    providers = shard_copies._providers(found, 5)
    assert providers[0] == (0, "undo") and providers[1] == (1, "own") and providers[2] == (2, "undo")
    # a survivor one step behind that updated its part holds it at the step the others completed
    found = [facts(0, steps=4, dirty=True), facts(1, steps=5), facts(2, steps=5), facts(3, steps=5)]
    assert shard_copies._providers(found, 5)[0] == (0, "own")


def test_after_a_skipped_step_a_part_one_step_behind_holds_it():
    """Step 6 was skipped (a loss scale's, not finite): rank 0 counted it; rank 1 and rank 2's keeper
    (rank 3) died out of it before their copies moved. It wrote nothing, so their parts at step 5 are
    at step 6; a step that was applied leaves them lost."""
    found = [facts(0, steps=6, version=6), facts(1), facts(3)]
    with pytest.raises(PeerFailedError, match="rank 1 holds its part at step 5, not 6"):
        shard_copies._providers(found, 6)
    found[0] = facts(0, steps=6, version=6, skipped=True)
    providers = shard_copies._providers(found, 6)
    assert providers[1] == (1, "own") and providers[2] == (2, "replica")


def test_a_rank_lost_with_its_keeper_is_an_error_that_says_so():
    with pytest.raises(PeerFailedError, match="rank 1 and its keeper, rank 2, were lost together"):
        shard_copies._providers([facts(0), facts(3)], 5)
    with pytest.raises(PeerFailedError, match="keeper holds its part at step 3, not 5"):
        shard_copies._providers([facts(0), facts(1), facts(3, version=3)], 5)


@pytest.mark.parametrize("bytes_per_pack", [0, 24])  # one pack; packs of 6 float32 (3 elements per rank)
@pytest.mark.parametrize("present", [[0, 1], [1]])  # every variable given a gradient, or only the second
def test_the_keeper_replays_the_partners_update_to_the_same_bits(bytes_per_pack, present):
    """The keeper (rank 0 of 2) replays rank 1's Adam step on its replica: the same bits as rank 1's own."""
    rng = np.random.default_rng(3)
    values = [rng.standard_normal(7).astype(np.float32), rng.standard_normal(4).astype(np.float32)]
    groups = []
    for rank in (0, 1):
        state = FlatState(("m", "v"), shard=True)
        state.add(
            [Variable(v.copy()) for v in values], None, ranks=2, rank=rank, bytes_per_pack=bytes_per_pack
        )
        groups.append(state.groups[0])
    keeper, owner = groups
    lay = owner.layout
    for g in groups:  # the same slots everywhere, as after a few steps
        for slot in g.slots.values():
            slot[...] = np.abs(rng.standard_normal(slot.size)).astype(np.float32)
    for name in owner.slots:
        keeper.slots[name][...] = owner.slots[name]
    gradient = rng.standard_normal(lay.slot_length).astype(np.float32)
    adam = Adam(0.1)
    copies = shard_copies.Copies([keeper], rank=0, size=2, shift=1)
    c = copies.groups[id(keeper)]
    c.replica[0][...] = shard_copies.part(lay, keeper.params.array, 1)
    for i, slot in enumerate(owner.slots.values()):
        c.replica[1 + i][...] = slot
    c.pending[...] = gradient
    partner_step = type("Step", (), {"group": keeper, "present": present})()
    c.mirror = shard_copies.Mirror.of(partner_step, 1)
    copies.pending_step, copies.call = 1, shard_copies.Call(adam._update_flat, 0.1, 0)
    shard_copies.advance(copies, [keeper])

    step = type("Step", (), {})()  # the owner's own update, as pack_step runs it
    step.group, step.updates = owner, [pack_step.owned_ranges(owner, present, k) for k in range(lay.packs)]
    params, slots = owner.params.claim(), owner.claim_slots()
    for k in range(lay.packs):
        block = gradient[k * lay.per_rank : (k + 1) * lay.per_rank].copy()
        pack_step.update_pack(step, k, block, lay.owned(k)[0], params, slots, adam._update_flat, 0.1, 0)
    assert c.replica[0].tobytes() == shard_copies.part(lay, params, 1).tobytes()
    for i, slot in enumerate(slots):
        assert c.replica[1 + i].tobytes() == slot.tobytes()
    assert copies.version == 1


# -- under MPI: the copies of a real sharded step ----------------------------------------------------

SHAPES = [(300,), (17, 5)]  # float32: 385 elements


@pytest.fixture
def survivable(monkeypatch):
    """The optimizers behave as where a death is survivable (Open MPI with --with-ft ulfm); the copies
    themselves are plain MPI (Sendrecv), so any MPI runs them."""
    monkeypatch.setattr(ulfm, "_live", True)


# Each optimizer with what its base arguments add around the update (the keeper replays it all):
# weight decay, clipping by the global norm and LAMB's trust ratios (norms summed over the ranks),
# clipping per variable, clipping values, the moving average and its overwrite, and a loss scale
# whose second step is not finite on rank 0 (skipped everywhere, nothing replayed).
OPTIMIZERS = {
    "Adam": (lambda: Adam(0.1, shard_state=True), np.float32),
    "AdamW": (lambda: AdamW(0.1, weight_decay=0.2, shard_state=True), np.float32),
    "Lamb global_clipnorm": (
        lambda: Lamb(0.1, weight_decay=0.01, global_clipnorm=0.5, shard_state=True),
        np.float32,
    ),
    "Lamb float64": (lambda: Lamb(0.1, clipnorm=0.3, shard_state=True), np.float64),
    "RMSprop centered": (
        lambda: RMSprop(
            0.1, momentum=0.5, centered=True, use_ema=True, ema_overwrite_frequency=2, shard_state=True
        ),
        np.float32,
    ),
    "SGD clipvalue": (lambda: SGD(0.1, momentum=0.9, clipvalue=0.2, shard_state=True), np.float32),
    "LossScale": (
        lambda: LossScaleOptimizer(Adagrad(0.1, shard_state=True), initial_scale=4.0),
        np.float32,
    ),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bytes_per_pack", [0, 512])
@pytest.mark.parametrize("which", list(OPTIMIZERS))
def test_each_step_sends_the_keeper_one_shard_and_its_replica_holds_the_partners_part(
    survivable, bytes_per_pack, which
):
    """Per step and rank, one ``Sendrecv`` of this rank's block of the summed gradients (one shard: the
    padded gradients over R) beside the reduce-scatter and all-gather; after every step the keeper's
    replica is the partner's own slots, bit for bit; and the weights are those of the steps without
    copies."""
    checks = RankChecks()
    make, dtype = OPTIMIZERS[which]
    options = CommunicationOptions(bytes_per_pack=bytes_per_pack)
    strategy = mpistrat.MPIStrategy(CountingComm(WORLD), communication_options=options)
    rank, size = strategy.extended.rank, strategy.num_replicas_in_sync
    rng = np.random.default_rng(rank)
    steps = [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(3)]
    if which == "LossScale" and rank == 0:
        steps[1][0][5] = np.inf  # the second step is skipped on every rank
    with strategy.scope():
        ws = [mpistrat.Variable(np.ones(s, dtype), name=f"w{k}") for k, s in enumerate(SHAPES)]
        opt = make()
    inner = getattr(opt, "inner_optimizer", opt)

    def replica_is_partners(when: str) -> None:
        copies, group = inner._state.copies, inner._state.groups[0]
        partner_slots = [
            WORLD.sendrecv(s, dest=copies.keeper, source=copies.partner) for s in group.slots.values()
        ]
        replica = copies.groups[id(group)].replica[1:]
        same = all(r.tobytes() == p.tobytes() for r, p in zip(replica, partner_slots, strict=True))
        all_ranks_agree(WORLD, same, f"{when}, rank {rank}: the replica differs from rank {copies.partner}'s")

    for n, grads in enumerate(steps):  # the copies are made whole at the first step
        with Ledger.recording() as ledger:
            strategy.run(lambda grads=grads: opt.apply_gradients(zip(grads, ws, strict=True)))
        replica_is_partners(f"after step {n + 1}")
        if n == 1:
            group = inner._state.groups[0]
            shard = group.layout.slot_length * np.dtype(dtype).itemsize  # this rank's part of a buffer
            exchanged = ledger.only("Sendrecv")
            checks.that(exchanged.calls == 1 and (exchanged.sent, exchanged.received) == (shard, shard))
            scatter = ledger.only("Reduce_scatter_block")
            checks.that(scatter.received == shard)  # the same shard the reduce-scatter hands this rank
            checks.agree(WORLD, f"{size} ranks: {ledger.log}")
    applied = int(inner.iterations.numpy())
    assert applied == (2 if which == "LossScale" else 3), applied
    ulfm._live = False  # the same steps without copies: the same weights
    with strategy.scope():
        plain_ws = [mpistrat.Variable(np.ones(s, dtype), name=f"p{k}") for k, s in enumerate(SHAPES)]
        plain = make()
    for grads in steps:
        strategy.run(lambda grads=grads: plain.apply_gradients(zip(grads, plain_ws, strict=True)))
    bits = all(w.numpy().tobytes() == p.numpy().tobytes() for w, p in zip(ws, plain_ws, strict=True))
    all_ranks_agree(WORLD, bits, "the weights differ from the steps without copies")
    strategy.experimental_finalize()
