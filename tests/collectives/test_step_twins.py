"""The two twins of ``MPISTRAT_CHECK=step``'s hot paths: the compiled ``native_step.c`` against the
Python reference (``step_check.PythonStepState``, ``monitor.PythonMarks``, ``closing.close_step``'s
watched handshake). The record's code against Python's own hash of the record's tuples, each
deferral's record against the Python twin's, the fields each state exposes (the C reads no
attribute of another object), a compiled closing's marks against the Python closing's, and ranks
running either twin in one job agreeing on every step and naming the same first difference.
(``tests/collectives/test_step_check.py`` runs whole under each twin.)"""

from __future__ import annotations

import re
import shlex
import shutil
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpistrat
from mpistrat import CollectiveMismatchError, CommunicationOptions
from mpistrat.collectives import step_check
from mpistrat.collectives.step_check import LIMIT, CompiledStepCheck, PythonStepCheck, PythonStepState
from mpistrat.diagnostics import stragglers
from mpistrat.diagnostics.monitor import PythonMarks
from tests.conftest import WORLD, RankChecks, raises_on_every_rank

compiled = step_check.native_step
needs_compiled = pytest.mark.skipif(CompiledStepCheck is None, reason="the compiled twin was not built")
KIND = "strategy.run (result)"
SOURCE = Path(step_check.__file__).with_name("native_step.c")


def test_the_compiled_twin_is_built_where_a_c_compiler_is():
    """``pip install .`` builds it where it finds a compiler; a failed build there is a defect, not
    a fallback to pass over (the install goes on without one: the extension is optional)."""
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}): the Python twin runs")
    import mpistrat.collectives.native_step  # noqa: F401  # raises where the build failed


def test_the_c_reads_and_writes_no_attribute_of_another_object():
    """``native_step.c`` looks up no attribute, method or module by name: its types read and write
    their own fields, and the closing calls what it is made with and is handed per call (a rename
    in Python then fails in Python, where the closing is made). StepState's kind coder is one."""
    source = SOURCE.read_text()
    assert re.findall(r"\b(Py\w*(?:Attr|Method)\w*|PyImport\w*)\(", source) == []
    assert "PyObject_CallFunctionObjArgs(self->coder, self->kinds, kind, NULL)" in source


def test_the_marks_are_the_same_fields_in_c_and_python():
    """The compiled marks' fields, as the C declares them, are the Python twin's slots."""
    declared = re.search(r"#define MARKS_FIELDS (.*?)\n\n", SOURCE.read_text(), re.S)
    assert declared is not None
    assert set(re.findall(r"X\((\w+)\)", declared.group(1))) == set(PythonMarks.__slots__)


@needs_compiled
def test_both_twins_expose_the_same_names():
    """What Python reads and calls of the state, the same on both: the fields (``learning`` written
    too), ``defer`` and ``record_code``; and the step check's own methods over either."""
    fields = {"learning", "record", "kinds", "limit", "coder"}
    assert set(PythonStepState.__slots__) == fields
    assert fields | {"defer", "record_code"} <= set(dir(compiled.StepState))
    for twin in (PythonStepCheck, CompiledStepCheck):
        step = twin()
        assert (step.learning, step.record, step.kinds, step.limit) == (True, [], {}, LIMIT)
        assert step.coder is step_check.kind_code
        step.learned()
        assert step.learning is False


@needs_compiled
def test_both_monitors_start_with_the_same_marks_and_keep_what_is_written():
    """A monitor over either twin's marks: each mark readable and writable by its name, the same at
    creation on both, and a collective's marks (its watch, ``enter`` and ``leave``) alike."""
    from mpi4py import MPI

    from mpistrat.collectives import Collectives
    from mpistrat.diagnostics.monitor import PythonMonitor

    fields = set(PythonMarks.__slots__)
    assert {name for name in dir(compiled.Marks) if not name.startswith("_")} == fields
    seen = {}
    for twin in (step_check.CompiledMonitor, PythonMonitor):
        monitor = twin(Collectives(MPI.COMM_SELF.Dup()))
        created = {name: getattr(monitor, name) for name in sorted(fields)}
        monitor.enter("all_reduce", 30.0)
        inside = (monitor.kind, monitor.polled, monitor.deadline - monitor.start)
        monitor.leave("all_reduce", 7, completed=True)
        monitor.handshakes += 2
        left = (monitor.start, monitor.deadline, monitor.polled, monitor.last[:2], monitor.completed)
        seen[twin] = (created, inside, left, monitor.handshakes)
    compiled_marks, python_marks = seen.values()
    assert compiled_marks == python_marks
    assert python_marks[0] == {
        "agreed": None,
        "completed": 0,
        "deadline": None,
        "handshakes": 0,
        "kind": "",
        "last": None,
        "last_thread": None,
        "polled": False,
        "start": None,
        "thread": None,
    }
    assert python_marks[1:] == (("all_reduce", True, 30.0), (None, None, False, ("all_reduce", 7), 7), 2)


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
    step = CompiledStepCheck()
    step.record.extend(record)
    assert step.record_code() == hash((tuple(record[0::3]), tuple(record[2::3])))


@needs_compiled
def test_a_deferral_records_what_the_python_twin_records():
    """The same calls through both twins: the same answers (not learned yet, recorded, the record
    full at LIMIT) and the same records, a kind's first call included."""
    twins = [CompiledStepCheck(), PythonStepCheck()]
    calls = [(seq, kind, (seq * 7919) << 40) for seq in range(1, LIMIT // 3 + 3) for kind in ["all_reduce"]]
    calls[5] = (6, "all_gather", -(2**62))  # a second kind, and a negative fingerprint
    answers = []
    for step in twins:
        got = [step.defer(1, "all_reduce", 3)]  # learning: every call sends
        step.learned()
        got += [step.defer(seq, kind, fingerprint) for seq, kind, fingerprint in calls]
        answers.append(got)
    native_step, python_step = twins
    assert answers[0] == answers[1]
    assert answers[1][:2] == [False, True] and answers[1][-2:] == [False] * 2
    assert native_step.record == python_step.record and len(python_step.record) == LIMIT
    assert native_step.kinds == python_step.kinds
    assert native_step.code() == python_step.code() != 0


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


@pytest.mark.mpi(min_size=2)
@needs_compiled
def test_ranks_running_either_twin_agree_and_name_the_same_first_difference(monkeypatch):
    """Rank 0 runs the Python twin, the others the compiled one: learned steps pass with the sums
    of serial NumPy, and a step where the last rank calls differently raises on every rank with the
    same message, naming the first collective that differed. Then they go on together."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    monkeypatch.setattr(step_check, "twin", PythonStepCheck if rank == 0 else CompiledStepCheck)
    strategy = mpistrat.MPIStrategy(WORLD, communication_options=CommunicationOptions(check="step"))
    checks = RankChecks()
    sums = [strategy.run(small_step, args=(rank,)) for _ in range(3)]
    checks.that(all(s == expected_sums(size) for s in sums))
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
    checks.that(all(m == messages[0] for m in messages))
    for _ in range(3):  # checked call by call again, then learned again
        checks.that(strategy.run(small_step, args=(rank,)) == expected_sums(size))
    closing = strategy.extended.collectives.native_closing
    closes = WORLD.allgather(closing.closes if closing else None)
    strategy.experimental_finalize()
    # closed compiled: the 2nd and 3rd steps before the error and after it (a first step is checked
    # call by call and closes in Python; the divergent step raised)
    checks.that(closes == [None] + [4] * (size - 1))
    checks.agree(WORLD, f"closings done compiled {closes}; {messages}")


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
    """The same steps on two strategies, one over each twin: the same numbers, monitor marks, flight
    record and tally after each learned step, whose unchecked calls follow a checked one; the
    closing marked finished, its record cleared, its tally forgotten. Counted: the compiled closing
    closed each learned step. A timeout chosen in the options or the environment polls the wait,
    which the compiled closing leaves to Python: it is then not made, and both close alike in
    Python. ``MPISTRAT_TIMEOUT=off`` polls nothing: compiled."""
    rank = WORLD.Get_rank()
    if environment is not None:
        monkeypatch.setenv("MPISTRAT_TIMEOUT", environment)  # read when a strategy is created
    options = CommunicationOptions(check="step", timeout_seconds=timeout)
    seen, closes = {}, None
    for twin in (CompiledStepCheck, PythonStepCheck):
        monkeypatch.setattr(step_check, "twin", twin)
        strategy = mpistrat.MPIStrategy(WORLD, communication_options=options)
        steps = []
        for _ in range(3):
            before = time.monotonic()
            sums = strategy.run(checked_in_the_middle, args=(rank,))
            steps.append({**marks(strategy, before), "sums": sums == expected_sums(WORLD.Get_size())})
        closing = strategy.extended.collectives.native_closing
        if twin is CompiledStepCheck:  # the 2nd and 3rd steps: the 1st closes in Python
            closes = closing.closes if closing else None
        strategy.experimental_finalize()
        seen[twin] = steps
    got, want = seen[CompiledStepCheck], seen[PythonStepCheck]
    polled = timeout is not None or environment not in (None, "off")
    checks = RankChecks()
    checks.that(got == want)
    checks.that(closes == (None if polled else 2))
    checks.that(want[-1]["last"] == (KIND, want[-1]["seq"]))
    checks.that(want[-1]["completed"] == want[-1]["seq"])
    checks.that(want[-1]["outgoing"] == (stragglers.NOTHING,) * 2)
    checks.that(want[-1]["record"] == [])
    checks.that(all(step["sums"] and step["times in order"] for step in want))
    checks.that(want[-1]["tallied"] > want[0]["tallied"])  # the checked calls' arrivals were filed
    checks.agree(WORLD, f"closings done compiled {closes}: {got} != {want}")
