"""Where an optimizer's flat buffers lie: large ones start on a 2 MiB boundary (whole huge pages),
and a step over them keeps copy-on-write.

The aligned buffer is a view into a longer allocation; were its slices based on that allocation
(as NumPy makes the slices of a plain view), ``FlatBuffer`` would not see a slice of a slice of a
variable's value held across a step, and the step would write into it. The reference is SGD's
``w - lr * g`` in float64 on gradients exact in float32.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpistrat
from mpistrat.optimizers import SGD
from mpistrat.training import placement
from tests.conftest import all_ranks_agree

LARGE = (1 << 20) + 3  # float32 elements: 4 MiB and a little, so not a whole number of huge pages


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("count", [0, 5, placement.LARGE // 8 - 1, placement.LARGE // 4, LARGE])
def test_buffers_of_large_bytes_start_on_a_huge_page(count, dtype):
    nbytes = count * np.dtype(dtype).itemsize
    made = [placement.empty(count, dtype), placement.zeros(count, dtype)]
    made.append(placement.copy(made[1]))
    for a in made:
        assert a.shape == (count,) and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        if nbytes >= placement.LARGE:
            assert a.ctypes.data % placement.HUGE_PAGE == 0
        # a slice of a slice is based on the buffer, as it is on an array that owns its memory
        assert a[1:][::2].base is a
    assert not made[1].any() and not made[2].any()


def test_a_copy_holds_the_values_and_not_the_memory():
    a = placement.zeros(LARGE, np.float32)
    a[::7] = 3.0
    b = placement.copy(a)
    b[0] = -1.0
    assert np.array_equal(b[1:], a[1:]) and a[0] == 3.0 and b.ctypes.data % placement.HUGE_PAGE == 0


READS = {  # each held alone across a step: a hold of the variable's own view would cover the others
    "slice of a slice": lambda w: w.value()[1:][::3],
    "slice of asarray": lambda w: np.asarray(w)[5:9],
}


@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_a_large_optimizer_state_is_aligned_and_keeps_values_read_before_a_step(world, shard, read):
    """Weights, slots and staging of a 4 MiB group start on huge pages (the slots of one rank's
    part, sharded, where that part is large); a value read before a step keeps what it read."""
    strategy = mpistrat.MPIStrategy(world.comm)
    lr = 0.5
    start = (np.arange(LARGE) % 8 / 4).astype(np.float32)
    with strategy.scope():
        w = mpistrat.Variable(start, name="w")
        b = mpistrat.Variable(np.ones(3, np.float32), name="b")
        opt = SGD(lr, momentum=0.5, shard_state=shard)
    rank, size = world.rank, world.size
    want, velocity = start.astype(np.float64), np.zeros(LARGE)
    bad = []
    for t in range(3):
        grad = np.full(LARGE, (rank + 1) * (t + 1) / 8, np.float32)
        held = READS[read](w)
        kept = held.copy()
        strategy.run(lambda grad=grad: opt.apply_gradients([(grad, w), (np.ones(3, np.float32), b)]))
        velocity = 0.5 * velocity - lr * (size * (size + 1) / 2) * (t + 1) / 8
        want = want + velocity
        if not np.array_equal(held, kept):
            bad.append(f"step {t}: the {read} read before it changed")
        del held
        if not np.allclose(w.numpy(), want, rtol=1e-6):
            bad.append(f"step {t}: w is {w.numpy()[:4]}, expected {want[:4]}")
    group = opt._flat_state().groups[0]
    buffers = {"weights": group.params.array, "staging": group.staging}
    buffers["momentum"] = group.claim_slots()[0]  # this rank's part, sharded
    for name, array in buffers.items():
        if array.nbytes >= placement.LARGE and array.ctypes.data % placement.HUGE_PAGE:
            bad.append(
                f"the {name} buffer starts {array.ctypes.data % placement.HUGE_PAGE} bytes into a huge page"
            )
    strategy.experimental_finalize()
    all_ranks_agree(world.comm, not bad, f"rank {rank}: " + "; ".join(bad))
