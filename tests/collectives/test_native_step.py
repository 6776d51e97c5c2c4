"""The compiled twins of ``MPISTRAT_CHECK=step``'s hot paths (``native_step.c``) against their Python
twins, the reference: the record's code against Python's own hash of the record's tuples, each
deferral's record against ``python_defer``'s, a compiled closing's marks (monitor, flight record,
straggler tally) against the Python closing's, and ranks running either twin in one job agreeing
on every step and naming the same first difference."""

from __future__ import annotations

import shlex
import shutil
import sysconfig
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpistrat
from mpistrat import CollectiveMismatchError, CommunicationOptions
from mpistrat.collectives import all_reduce as all_reduce_module
from mpistrat.collectives import handshake, native, step_check
from mpistrat.collectives.step_check import LIMIT, StepCheck, python_defer, python_record_code
from mpistrat.diagnostics import stragglers
from tests.conftest import WORLD, all_ranks_agree, raises_on_every_rank

compiled = native.native_step
needs_compiled = pytest.mark.skipif(compiled is None, reason=f"the step check runs {native.describe()}")
KIND = "strategy.run (result)"


def test_the_compiled_twins_are_built_where_a_c_compiler_is():
    """``pip install .`` builds them where it finds a compiler; a failed build there is a defect, not
    a fallback to pass over (the install goes on without one: the extension is optional)."""
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}): the Python twins run")
    import mpistrat.collectives.native_step  # noqa: F401  # raises where the build failed


# records as defer leaves them (number, kind, code), and any list of such items
triples = st.lists(
    st.tuples(
        st.integers(0, 2**40),
        st.sampled_from(["all_reduce", "all_gather", "broadcast", "ä kind"]),
        st.integers(-(2**63), 2**63 - 1),
    ),
    max_size=40,
).map(lambda triples: [x for t in triples for x in t])
records = triples | st.lists(st.one_of(st.integers(-(2**70), 2**70), st.text(max_size=3)), max_size=12)


@needs_compiled
@given(records)
def test_the_records_code_is_pythons_hash_of_its_numbers_and_codes(record):
    assert compiled.record_code(record) == hash((tuple(record[0::3]), tuple(record[2::3])))


@needs_compiled
def test_a_deferral_records_what_the_python_twin_records():
    """The same calls through both twins: the same answers (not learned yet, recorded, the record
    full at LIMIT) and the same records, a kind's first call included."""
    twins = {defer: StepCheck([]) for defer in (compiled.defer, python_defer)}
    calls = [(seq, kind, (seq * 7919) << 40) for seq in range(1, LIMIT // 3 + 3) for kind in ["all_reduce"]]
    calls[5] = (6, "all_gather", -(2**62))  # a second kind, and a negative fingerprint
    answers = {}
    for defer, step in twins.items():
        got = [defer(step, 1, "all_reduce", 3)]  # learning: every call sends
        step.learned()
        got += [defer(step, seq, kind, fingerprint) for seq, kind, fingerprint in calls]
        got.append(defer(None, 1, "all_reduce", 3))  # no step check (the check on)
        answers[defer] = got
    native_step, python_step = twins.values()
    assert answers[compiled.defer] == answers[python_defer]
    assert answers[python_defer][:2] == [False, True] and answers[python_defer][-3:] == [False] * 3
    assert native_step.record == python_step.record and len(python_step.record) == LIMIT
    assert native_step.kinds == python_step.kinds


def small_step(rank):
    ctx = mpistrat.get_replica_context()
    return [ctx.all_reduce("sum", np.array([rank + i], np.float32)) for i in range(8)]


def checked_in_the_middle(rank):
    """small_step with one call checked at once (its own options): its handshake times this rank's
    wait, which the closing's tally must forget."""
    ctx = mpistrat.get_replica_context()
    checked = CommunicationOptions(check=True)
    return [
        ctx.all_reduce("sum", np.array([rank + i], np.float32), options=checked if i == 4 else None)
        for i in range(8)
    ]


def expected_sums(size):
    return [np.float32(sum(np.float32(r + i) for r in range(size))) for i in range(8)]


def python_twins(monkeypatch, strategy):
    """Make this rank run the Python twins (the deferral, the record's code, the closing)."""
    monkeypatch.setattr(all_reduce_module, "defer", python_defer)
    monkeypatch.setattr(handshake, "defer", python_defer)
    monkeypatch.setattr(step_check, "record_code", python_record_code)
    strategy.extended.collectives.native_closing = False


@pytest.mark.mpi(min_size=2)
@needs_compiled
def test_ranks_running_either_twin_agree_and_name_the_same_first_difference(monkeypatch):
    """Rank 0 runs the Python twins, the others the compiled ones: learned steps pass with the sums
    of serial NumPy, and a step where the last rank calls differently raises on every rank with the
    same message, naming the first collective that differed. Then they go on together."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    strategy = mpistrat.MPIStrategy(WORLD, communication_options=CommunicationOptions(check="step"))
    if rank == 0:
        python_twins(monkeypatch, strategy)
    sums = [strategy.run(small_step, args=(rank,)) for _ in range(3)]
    ok = all(s == expected_sums(size) for s in sums)
    x = np.ones(4, np.float32)

    def step(other):
        ctx = mpistrat.get_replica_context()
        return [ctx.all_reduce("sum", x.reshape(2, 2) if other else x), ctx.all_reduce("mean", x)]

    first = strategy.extended.collectives.seq + 1
    message = raises_on_every_rank(
        WORLD,
        CollectiveMismatchError,
        lambda: strategy.run(step, args=(rank == size - 1,)),
        match=f"collective #{first} ran unchecked",
    )
    messages = WORLD.allgather(message)
    ok = ok and all(m == messages[0] for m in messages)
    for _ in range(3):  # checked call by call again, then learned again
        ok = ok and strategy.run(small_step, args=(rank,)) == expected_sums(size)
    closing = strategy.extended.collectives.native_closing
    closes = WORLD.allgather(closing.closes if closing else None)
    strategy.experimental_finalize()
    # closed compiled: the 2nd and 3rd steps before the error and after it (a first step is checked
    # call by call and closes generically; the divergent step raised)
    ok = ok and closes == [None] + [4] * (size - 1)
    all_ranks_agree(WORLD, ok, f"closings done compiled {closes}; {messages}")


def marks(strategy, before):
    """What a closing begun after ``before`` (monotonic) leaves behind, its times as their order: the
    monitor's marks, the last flight record, the record, the straggler tally (what it filed from
    the step's checked call, and what it sends next)."""
    collectives = strategy.extended.collectives
    monitor, tally = collectives.monitor, collectives.stragglers
    seq, began, fingerprint, sent, ended, *rest = collectives.flight[-1]
    return {
        "seq": collectives.seq,
        "handshakes": collectives.handshakes,
        "failures": collectives.failures,
        "completed": monitor.completed,
        "last": monitor.last[:2],
        "times in order": before <= monitor.agreed <= sent <= ended <= monitor.last[2],
        "idle": (monitor.start, monitor.deadline, monitor.polled, monitor.thread, monitor.busy.locked()),
        "entry": (seq, began, fingerprint, rest),
        "record": list(collectives.step_check.record),
        "tallied": tally.collectives,
        "outgoing": tally.outgoing,
    }


@pytest.mark.mpi(min_size=2)
@needs_compiled
@pytest.mark.parametrize(
    ("timeout", "environment"), [(None, None), (None, "off"), (30.0, None), (None, "30")]
)
def test_a_compiled_closing_leaves_the_marks_the_python_closing_leaves(monkeypatch, timeout, environment):
    """The same steps on two strategies, one closing in Python: the same numbers, monitor marks,
    flight record and tally after each learned step, whose unchecked calls follow a checked one.
    Counted: the compiled closing closed each learned step. A timeout chosen in the options or the
    environment polls the wait, which the compiled closing leaves to Python: it is then not made, and
    both close alike in Python. ``MPISTRAT_TIMEOUT=off`` polls nothing: compiled."""
    rank = WORLD.Get_rank()
    if environment is not None:
        monkeypatch.setenv("MPISTRAT_TIMEOUT", environment)  # read when a strategy is created
    options = CommunicationOptions(check="step", timeout_seconds=timeout)
    compiled_one = mpistrat.MPIStrategy(WORLD, communication_options=options)
    python_one = mpistrat.MPIStrategy(WORLD, communication_options=options)
    python_one.extended.collectives.native_closing = False
    seen = {}
    for strategy in (compiled_one, python_one):
        steps = []
        for _ in range(3):
            before = time.monotonic()
            sums = strategy.run(checked_in_the_middle, args=(rank,))
            steps.append({**marks(strategy, before), "sums": sums == expected_sums(WORLD.Get_size())})
        seen[strategy] = steps
    closing = compiled_one.extended.collectives.native_closing
    closes = closing.closes if closing else None  # the 2nd and 3rd steps: the 1st closes generically
    compiled_one.experimental_finalize()
    python_one.experimental_finalize()
    got, want = seen[compiled_one], seen[python_one]
    polled = timeout is not None or environment not in (None, "off")
    ok = got == want and closes == (None if polled else 2)
    ok = ok and want[-1]["last"] == (KIND, want[-1]["seq"]) and want[-1]["completed"] == want[-1]["seq"]
    ok = ok and want[-1]["outgoing"] == (stragglers.NOTHING,) * 2 and want[-1]["record"] == []
    ok = ok and all(step["sums"] and step["times in order"] for step in want)
    ok = ok and want[-1]["tallied"] > want[0]["tallied"]  # the checked calls' arrivals were filed
    all_ranks_agree(WORLD, ok, f"closings done compiled {closes}: {got} != {want}")
