"""An optimizer's ``communication_options`` take effect for every field it sets, over the strategy's.

Counted per rank with the counting communicator: the sums a step makes with an optimizer's
``bytes_per_pack`` are those it makes with the same option on the strategy (they used to be the
strategy's one pack per dtype: one ``Allreduce`` where four were asked for), for the list step and
the generator step, sharded or not, at any rank count. An optimizer's ``check="strict"`` compares
the copies its step wrote, an optimizer's ``check=False`` leaves its step's handshake out.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpistrat
from mpistrat import CollectiveMismatchError, CommunicationOptions
from mpistrat.optimizers import SGD
from mpistrat.values import local_variable
from tests.conftest import WORLD, all_ranks_agree, raises_on_every_rank
from tests.support.counting import CountingComm, Ledger

SIZES = [1000, 3, 2500]  # float32 elements, uneven on purpose: 14,012 bytes
PACK = 4096  # bytes: 1024 float32 per pack (whole blocks of each rank's share, sharded)
HANDSHAKE = 13 * 8  # bytes of a handshake, which is not a sum


def expected_packs(size: int, shard: bool) -> int:
    """Packs of at most PACK bytes, each of whole per-rank blocks when sharded (the layout's rule)."""
    per_rank = -(-(PACK // 4) // size) if shard else PACK // 4
    return -(-sum(SIZES) // (per_rank * (size if shard else 1)))


def sums_per_step(strategy_options, optimizer_options, shard: bool, stream: bool) -> int:
    strategy = mpistrat.MPIStrategy(CountingComm(WORLD), communication_options=strategy_options)
    with strategy.scope():
        ws = [mpistrat.Variable(np.zeros(n, np.float32), name=f"w{k}") for k, n in enumerate(SIZES)]
        opt = SGD(0.1, shard_state=shard, communication_options=optimizer_options)
    grads = [np.ones(n, np.float32) for n in SIZES]
    strategy.run(lambda: opt.apply_gradients(list(zip(grads, ws, strict=True))))  # builds
    with Ledger.recording() as ledger:
        if stream:
            pairs = list(zip(grads, ws, strict=True))
            strategy.run(lambda: opt.apply_gradients(pair for pair in reversed(pairs)))
        else:
            strategy.run(lambda: opt.apply_gradients(list(zip(grads, ws, strict=True))))
    with strategy.scope():
        ok = all(np.allclose(w.numpy(), -0.2 * WORLD.Get_size()) for w in ws)
    strategy.experimental_finalize()
    assert ok, "the step's weights are not NumPy's"
    sums = ledger.only("Allreduce", "Reduce_scatter_block")
    return sum(1 for c in sums.log if c.sent > HANDSHAKE)


@pytest.mark.parametrize("stream", [False, True], ids=["list", "generator"])
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_an_optimizers_bytes_per_pack_cuts_its_step_into_the_packs_it_asks_for(shard, stream):
    size = WORLD.Get_size()
    packed = CommunicationOptions(bytes_per_pack=PACK)
    mine = sums_per_step(None, packed, shard, stream)
    strategys = sums_per_step(packed, None, shard, stream)
    neither = sums_per_step(None, None, shard, stream=False)
    want = expected_packs(size, shard)
    ok = mine == strategys == want and neither == 1 and want > 1
    all_ranks_agree(WORLD, ok, f"optimizer's {mine}, strategy's {strategys}, none {neither}; expected {want}")


@pytest.mark.parametrize("stream", [False, True], ids=["list", "generator"])
def test_an_optimizers_strict_check_compares_the_copies_its_step_wrote(stream):
    """A copy that differs on the last rank (written there alone) diverges through the step: the
    optimizer's ``check="strict"`` fails every rank naming the variable; without it the step passes."""
    size = WORLD.Get_size()
    if size == 1:
        pytest.skip("needs two copies to differ")
    for check, raises in ((None, False), ("strict", True)):
        strategy = mpistrat.MPIStrategy(WORLD)
        with strategy.scope():
            w = mpistrat.Variable(np.zeros(4, np.float32), name="w")
            opt = SGD(0.1, communication_options=CommunicationOptions(check=check))
        strategy.run(lambda: opt.apply_gradients([(np.ones(4, np.float32), w)]))  # noqa: B023 (builds)
        if WORLD.Get_rank() == size - 1:
            local_variable(w).assign(np.ones(4, np.float32))

        def step():
            pairs = [(np.ones(4, np.float32), w)]  # noqa: B023
            given = (pair for pair in pairs) if stream else pairs
            strategy.run(lambda: opt.apply_gradients(given))  # noqa: B023

        if raises:
            raises_on_every_rank(WORLD, CollectiveMismatchError, step, "'w'")
        else:
            step()
        strategy.experimental_finalize()


def test_an_optimizers_check_off_leaves_its_steps_handshake_out():
    """Counted: with ``check=False`` on the optimizer alone its step sends the sum and no handshake;
    ``strategy.run``'s own closing is the strategy's."""
    counts = {}
    for check in (None, False):
        strategy = mpistrat.MPIStrategy(CountingComm(WORLD))
        with strategy.scope():
            w = mpistrat.Variable(np.zeros(8, np.float32), name="w")
            opt = SGD(0.1, communication_options=CommunicationOptions(check=check))
        strategy.run(lambda: opt.apply_gradients([(np.ones(8, np.float32), w)]))  # noqa: B023
        with Ledger.recording() as ledger:
            strategy.run(lambda: opt.apply_gradients([(np.ones(8, np.float32), w)]))  # noqa: B023
        with Ledger.recording() as empty:
            strategy.run(lambda: None)
        counts[check] = ledger.calls - empty.calls
        strategy.experimental_finalize()
    want = {None: 2, False: 1} if WORLD.Get_size() > 1 else counts
    all_ranks_agree(WORLD, counts == want, f"calls per step {counts}, expected {want}")
