"""Gradient accumulation: ``SGD/Adam(..., gradient_accumulation_steps=K)``.

K-1 of every K ``apply_gradients`` calls add this rank's gradients locally and send nothing
(counted on a counting communicator); the K-th reduces once and applies the mean of the K
calls' gradients, summed over the ranks. The expected weights and slots come from the serial
float64 NumPy reference of the flat optimizers' tests, stepped with that mean; ``iterations``
counts updates, as Keras 3's does.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat
from mpistrat import CommunicationOptions, InvalidArgumentError
from mpistrat.optimizers import SGD, Adam
from tests.conftest import WORLD, RankChecks, all_ranks_agree, raises_on_every_rank
from tests.support.counting import CountingComm, Ledger
from tests.training.test_flat_optimizers import (
    B1,
    B2,
    EPS,
    LR,
    MOMENTUM,
    NAMES,
    Reference,
    differences,
    local_grad,
    make_variables,
    reference_slots,
    same_bytes_on_every_rank,
    slots,
    summed_grad,
    weights,
)

K = 3
UPDATES = 2


def make(kind: str, shard: bool, steps=K, **options):
    if kind == "momentum":
        return SGD(LR, momentum=MOMENTUM, shard_state=shard, gradient_accumulation_steps=steps, **options)
    return Adam(
        LR, beta_1=B1, beta_2=B2, epsilon=EPS, shard_state=shard, gradient_accumulation_steps=steps, **options
    )


def micro_step(strategy, opt, variables, t: int, rank: int) -> None:
    pairs = [(local_grad(n, t, rank), variables[n]) for n in NAMES]
    strategy.run(lambda: opt.apply_gradients(pairs))


@pytest.fixture
def strategy(group):
    made = mpistrat.MPIStrategy(group.comm, communication_options=CommunicationOptions(bytes_per_pack=32))
    yield made
    made.experimental_finalize()


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_each_update_applies_the_mean_of_k_calls(group, strategy, kind, shard):
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make(kind, shard)
    ref = Reference("momentum" if kind == "momentum" else "adam")
    bad = []
    for u in range(UPDATES):
        for i in range(K):
            micro_step(strategy, opt, variables, u * K + i, group.rank)
            if i < K - 1 and int(opt.iterations.numpy()) != u:
                bad.append(f"iterations {int(opt.iterations.numpy())} after a quiet call of update {u}")
        ref.step({n: sum(summed_grad(n, u * K + i, group.size) for i in range(K)) / K for n in NAMES})
        got = weights(variables)
        bad += differences(got, ref.params)
    got_slots = slots(opt, variables, kind)
    bad += differences(got_slots, reference_slots(ref))
    if int(opt.iterations.numpy()) != UPDATES or opt.gradient_accumulation_steps != K:
        bad.append(f"iterations {opt.iterations.numpy()}, steps {opt.gradient_accumulation_steps}")
    if not same_bytes_on_every_rank(group.comm, {**weights(variables), **got_slots}):
        bad.append("the copies differ between ranks")
    all_ranks_agree(group.comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_quiet_calls_move_no_bytes_and_the_kth_moves_one_step(shard):
    """Counted: calls 1..K-1 make no MPI call of their own (the calls of an empty strategy.run: its
    closing handshake above one rank); the K-th makes exactly the calls of a step without
    accumulation, with the same bytes."""
    strategy = mpistrat.MPIStrategy(CountingComm(WORLD))
    variables = make_variables(strategy)
    with strategy.scope():
        accumulating, plain = make("adam", shard), make("adam", shard, steps=None)
    rank = WORLD.Get_rank()
    micro_step(strategy, plain, variables, 0, rank)  # both built before counting
    for i in range(K):
        micro_step(strategy, accumulating, variables, i, rank)
    with Ledger.recording() as one_plain:
        micro_step(strategy, plain, variables, 1, rank)
    with Ledger.recording() as empty:
        strategy.run(lambda: None)
    with Ledger.recording() as quiet:
        for i in range(K - 1):
            micro_step(strategy, accumulating, variables, K + i, rank)
    with Ledger.recording() as last:
        micro_step(strategy, accumulating, variables, 2 * K - 1, rank)
    run_only = [(c.name, c.sent) for c in empty.log] * (K - 1)
    summary = ([(c.name, c.sent) for c in quiet.log], [(c.name, c.sent) for c in last.log])
    plain_log = [(c.name, c.sent) for c in one_plain.log]
    ok = summary[0] == run_only and summary[1] == plain_log and len(plain_log) > len(empty.log)
    strategy.experimental_finalize()
    all_ranks_agree(WORLD, ok, f"size {WORLD.Get_size()}: {summary}, plain {plain_log}, run {run_only}")


@pytest.mark.parametrize("steps", [0, -2, 2.0, "3", True])
def test_bad_steps_name_what_was_expected(steps):
    with pytest.raises(
        InvalidArgumentError, match=r"gradient_accumulation_steps must be a positive integer.*got"
    ):
        SGD(0.1, gradient_accumulation_steps=steps)


def test_one_step_is_no_accumulation(group, strategy):
    variables = make_variables(strategy)
    with strategy.scope():
        opt = SGD(LR, gradient_accumulation_steps=1)
    micro_step(strategy, opt, variables, 0, group.rank)
    ref = Reference("sgd")
    ref.step({n: summed_grad(n, 0, group.size) for n in NAMES})
    bad = differences(weights(variables), ref.params)
    all_ranks_agree(group.comm, not bad and int(opt.iterations.numpy()) == 1, "; ".join(bad))


def test_bad_gradient_on_a_quiet_call_raises_on_every_rank_at_the_update(group, strategy):
    """One rank's wrong shape on call 1 of 3 sends nothing then; the update's handshake makes it an
    error on every rank, and no variable is written."""
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make("adam", False)
    before = weights(variables)
    bad_rank = group.size - 1
    pairs = [(local_grad(n, 0, group.rank), variables[n]) for n in NAMES]
    if group.rank == bad_rank:
        pairs[0] = (np.zeros(7, np.float32), variables[NAMES[0]])
    strategy.run(lambda: opt.apply_gradients(pairs))  # quiet: nothing raised yet
    micro_step(strategy, opt, variables, 1, group.rank)
    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: micro_step(strategy, opt, variables, 2, group.rank),
        match="has shape (7,)",
    )
    after = weights(variables)
    same = all(np.array_equal(before[n], after[n]) for n in NAMES)
    all_ranks_agree(group.comm, same and int(opt.iterations.numpy()) == 0, "a variable was written")


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_kth_call_whose_step_overflows_applies_the_cycle_once_when_retried(group, shard, dtype):
    """fp16 compression overflows in the K-th call's reduction: nothing is written, on every rank, and
    retrying that call (a smaller loss scale) applies the cycle's mean once, as a step without
    accumulation does."""
    options = CommunicationOptions(compression="fp16")
    strategy = mpistrat.MPIStrategy(group.comm, communication_options=options)
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(4, dtype), name="w")
        opt = SGD(1.0, shard_state=shard, gradient_accumulation_steps=2)
    call = lambda g: strategy.run(lambda: opt.apply_gradients([(np.full(4, g, dtype), w)]))  # noqa: E731
    call(2.0)
    raises_on_every_rank(group.comm, InvalidArgumentError, lambda: call(2e5), match="fp16")  # a mean of 1e5
    unwritten = np.all(w.numpy() == 0) and int(opt.iterations.numpy()) == 0
    call(2.0)  # the retry: the cycle's mean is (2 + 2) / 2 on each rank
    want = -2.0 * group.size
    ok = unwritten and np.all(w.numpy() == want) and int(opt.iterations.numpy()) == 1
    strategy.experimental_finalize()
    all_ranks_agree(group.comm, ok, f"unwritten {unwritten}; w {w.numpy()} want {want}")


@pytest.mark.parametrize("last", [False, True], ids=["quiet call", "kth call"])
def test_a_call_with_other_variables_is_an_error_naming_them_and_the_next_cycle_is_clean(
    group, strategy, last
):
    with strategy.scope():
        w, b, c = (mpistrat.Variable(np.zeros(2, np.float32), name=n) for n in "wbc")
        opt = SGD(1.0, gradient_accumulation_steps=K)
    opt.build([w, b, c])
    ones = np.ones(2, np.float32)
    call = lambda *vs: strategy.run(lambda: opt.apply_gradients([(ones, v) for v in vs]))  # noqa: E731
    for t in range(K - 1):
        call(w, c) if t == K - 2 and not last else call(w, b)
    raises_on_every_rank(
        group.comm,
        InvalidArgumentError,
        lambda: call(w, c) if last else call(w, b),
        match="'w', 'c', where the",
    )
    for _ in range(K):  # a clean cycle: each variable moves by the mean of K ones, summed over the ranks
        call(w, b)
    ok = np.all(w.numpy() == -group.size) and np.all(c.numpy() == 0) and int(opt.iterations.numpy()) == 1
    all_ranks_agree(group.comm, ok, f"w {w.numpy()} c {c.numpy()} iterations {int(opt.iterations.numpy())}")


@pytest.mark.parametrize("call", [0, K - 2], ids=["first call", "later call"])
def test_a_complex_gradient_for_a_float_variable_on_one_rank_is_an_error_on_every_rank(group, strategy, call):
    """Kept, as a wrong shape is: not cast to its real part (the first call) nor a NumPy error on one
    rank (a later call), which left that rank's cycle a call behind the others'."""
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(2, np.float32), name="w")
        opt = SGD(1.0, gradient_accumulation_steps=K)

    def micro(t):
        grad = (
            np.ones(2, np.complex128)
            if t == call and group.rank == group.size - 1
            else np.ones(2, np.float32)
        )
        strategy.run(lambda: opt.apply_gradients([(grad, w)]))

    for t in range(K - 1):
        micro(t)
    raises_on_every_rank(group.comm, InvalidArgumentError, lambda: micro(K - 1), match="is complex128")
    for t in range(K):  # a clean cycle on every rank
        micro(K + t)
    ok = np.all(w.numpy() == -group.size) and int(opt.iterations.numpy()) == 1
    all_ranks_agree(group.comm, ok, f"w {w.numpy()} iterations {int(opt.iterations.numpy())}")


# -- checkpoints: a job saved mid-cycle resumes it ----------------------------------------------


def shared_dir(group, tmp_path) -> str:
    return group.comm.bcast(str(tmp_path) if group.rank == 0 else None, root=0)


@pytest.mark.parametrize("deterministic", [False, True], ids=["plain", "exact"])
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_a_checkpoint_saved_mid_cycle_resumes_it_bit_for_bit(group, tmp_path, shard, deterministic):
    """Save after K-1 calls, restore into new variables and a new optimizer, finish: the weights and
    slots are the bytes of a run never interrupted."""
    options = CommunicationOptions(deterministic=deterministic, bytes_per_pack=32)
    strategy = mpistrat.MPIStrategy(group.comm, communication_options=options)

    def fresh():
        variables = make_variables(strategy)
        with strategy.scope():
            return variables, make("adam", shard)

    variables, opt = fresh()
    for t in range(2 * K):
        micro_step(strategy, opt, variables, t, group.rank)
    want = {**weights(variables), **slots(opt, variables, "adam")}

    variables, opt = fresh()
    checkpoint = mpistrat.Checkpoint(model=variables, opt=opt)
    for t in range(K + K - 1):
        micro_step(strategy, opt, variables, t, group.rank)
    path = checkpoint.save(f"{shared_dir(group, tmp_path)}/ckpt")
    variables, opt = fresh()
    checkpoint = mpistrat.Checkpoint(model=variables, opt=opt)
    checkpoint.restore(path).assert_consumed()
    resumed_iterations = int(opt.iterations.numpy())
    micro_step(strategy, opt, variables, 2 * K - 1, group.rank)
    got = {**weights(variables), **slots(opt, variables, "adam")}
    bad = [n for n in want if got[n].tobytes() != want[n].tobytes()]
    ok = not bad and resumed_iterations == 1 and int(opt.iterations.numpy()) == 2
    strategy.experimental_finalize()
    all_ranks_agree(group.comm, ok, f"differ: {bad}, iterations {resumed_iterations}")


@pytest.mark.parametrize("restored_steps", [2, 6])
def test_a_cycle_restored_into_another_k_applies_the_mean_of_all_its_calls(
    group, strategy, tmp_path, restored_steps
):
    """Saved after 3 of K=4 calls: restored with K=2 the next call ends the cycle, with K=6 the third
    one does; either way the update is the mean of every call's gradient (not their sum over the new K)."""

    def fresh(steps):
        with strategy.scope():
            w = mpistrat.Variable(np.zeros(2, np.float64), name="w")
            return w, SGD(1.0, gradient_accumulation_steps=steps)

    w, opt = fresh(4)
    checkpoint = mpistrat.Checkpoint(model={"w": w}, opt=opt)
    call = lambda t: strategy.run(lambda: opt.apply_gradients([(np.full(2, t + 1.0), w)]))  # noqa: E731
    for t in range(3):
        call(t)
    path = checkpoint.save(f"{shared_dir(group, tmp_path)}/ckpt")
    w, opt = fresh(restored_steps)
    mpistrat.Checkpoint(model={"w": w}, opt=opt).restore(path).assert_consumed()
    calls = max(restored_steps, 4)  # the cycle's calls in all: the restored 3 and these
    for t in range(3, calls):
        call(t)
    want = -group.size * sum(t + 1.0 for t in range(calls)) / calls
    ok = np.all(w.numpy() == want) and int(opt.iterations.numpy()) == 1
    all_ranks_agree(group.comm, ok, f"w {w.numpy()} want {want}, iterations {int(opt.iterations.numpy())}")


def test_a_checkpoint_saved_between_cycles_forgets_a_cycle_in_progress(group, strategy, tmp_path):
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make("momentum", False)
    checkpoint = mpistrat.Checkpoint(model=variables, opt=opt)
    for t in range(K):
        micro_step(strategy, opt, variables, t, group.rank)
    path = checkpoint.save(f"{shared_dir(group, tmp_path)}/ckpt")  # between cycles
    micro_step(strategy, opt, variables, 5, group.rank)  # one call of a cycle, then back
    checkpoint.restore(path).assert_consumed()
    for t in range(K):  # a whole cycle of these calls alone
        micro_step(strategy, opt, variables, 10 + t, group.rank)
    ref = Reference("momentum")
    for first in (0, 10):
        ref.step({n: sum(summed_grad(n, first + t, group.size) for t in range(K)) / K for n in NAMES})
    bad = differences(weights(variables), ref.params)
    all_ranks_agree(group.comm, not bad and int(opt.iterations.numpy()) == 2, "; ".join(bad))


def test_a_cycle_saved_part_way_resumes_only_at_its_rank_count(tmp_path):
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    if size == 1:
        pytest.skip("needs another rank count than the one that saved")
    world = mpistrat.MPIStrategy(WORLD.Dup())
    variables = make_variables(world)
    with world.scope():
        opt = make("momentum", False)
    micro_step(world, opt, variables, 0, rank)
    directory = WORLD.bcast(str(tmp_path) if rank == 0 else None)
    path = mpistrat.Checkpoint(model=variables, opt=opt).save(f"{directory}/ckpt")
    world.experimental_finalize()
    alone = mpistrat.MPIStrategy(MPI.COMM_SELF.Dup())
    variables = make_variables(alone)
    with alone.scope():
        opt = make("momentum", False)
    checkpoint = mpistrat.Checkpoint(model=variables, opt=opt)
    raises_on_every_rank(
        WORLD, InvalidArgumentError, lambda: checkpoint.restore(path), match="resumes only at the rank count"
    )
    alone.experimental_finalize()


def test_a_save_part_way_through_a_window_is_said_once(group, strategy, tmp_path, mpistrat_log):
    """On rank 0, once: the window the save fell in, and the rank count the file then restores at;
    nothing for a save between windows."""
    checks = RankChecks()
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make("momentum", False)
    checkpoint = mpistrat.Checkpoint(model=variables, opt=opt)
    prefix = f"{shared_dir(group, tmp_path)}/ckpt"
    for t in range(K):
        micro_step(strategy, opt, variables, t, group.rank)
    checkpoint.save(prefix)  # between windows
    between = [m for _, m in mpistrat_log if "accumulation window" in m]
    micro_step(strategy, opt, variables, K, group.rank)
    checkpoint.save(prefix)  # 1 of 3 calls into the next window
    micro_step(strategy, opt, variables, K + 1, group.rank)
    checkpoint.save(prefix)  # 2 of 3: said already
    said = [(level, m) for level, m in mpistrat_log if "accumulation window" in m]
    want = (
        "Checkpoint.save: saved part-way through a gradient accumulation window (optimizer 'opt' "
        f"(1 of {K} calls)): the file holds each rank's accumulated gradients, so it restores only at "
        f"{group.size} ranks"
    )
    if WORLD.Get_rank() == 0:  # the logger passes world rank 0's warnings
        checks.that(between == [] and len(said) == 1)
        checks.that(  # the message, once there is one
            len(said) == 1
            and said[0][0] == "WARNING"
            and said[0][1].startswith(want)
            and "CheckpointManager(..., save_at_window_end=True)" in said[0][1]
        )
    else:
        checks.that(said == [])
    checks.agree(group.comm, f"{between} {said}")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_manager_told_to_saves_at_the_windows_end_and_the_file_restores_at_one_rank(
    group, strategy, tmp_path, asynchronous
):
    """save_at_window_end: a save() called after the window's first call returns its path at once and
    is made at the end of the step whose call ends the window: the weights after that update (the
    serial reference's), no accumulation entries, so one rank restores it; a save between windows is
    made at once, as without the option."""
    from mpistrat.checkpoint.files import read_table

    directory = shared_dir(group, tmp_path)
    variables = make_variables(strategy)
    with strategy.scope():
        opt = make("momentum", False)
    checkpoint = mpistrat.Checkpoint(model=variables, opt=opt)
    manager = mpistrat.CheckpointManager(checkpoint, directory, max_to_keep=None, save_at_window_end=True)
    options = mpistrat.CheckpointOptions(enable_async=asynchronous)
    micro_step(strategy, opt, variables, 0, group.rank)
    path = manager.save(options=options)  # 1 of 3 calls
    made = [os.path.exists(path)]
    for t in (1, 2):
        micro_step(strategy, opt, variables, t, group.rank)
        made.append(os.path.exists(path))
    manager.sync()
    ref = Reference("momentum")
    ref.step({n: sum(summed_grad(n, t, group.size) for t in range(K)) / K for n in NAMES})
    table = read_table(path)
    checks = RankChecks()
    checks.that(
        made[:2] == [False, False] and (made[2] or asynchronous) and manager.latest_checkpoint == path
    )
    checks.that(not [n for n in table.entries if "/accumulation/" in n])
    first = manager.save()  # between windows: at once
    checks.that(os.path.exists(first) and first != path)
    alone = mpistrat.MPIStrategy(MPI.COMM_SELF.Dup())  # another rank count than the one that saved
    restored = make_variables(alone)
    with alone.scope():
        opt1 = make("momentum", False)
    mpistrat.Checkpoint(model=restored, opt=opt1).restore(path).assert_consumed()
    bad = differences(weights(restored), ref.params)
    alone.experimental_finalize()
    checks.that(not bad)
    checks.agree(group.comm, f"{made} {sorted(table.entries)} {bad}")
