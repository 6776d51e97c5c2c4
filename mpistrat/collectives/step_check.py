"""``MPISTRAT_CHECK=step``: every collective checked in the first step, then once per step.

With the check on, every collective opens with a handshake: one more latency per call. Under
``step`` the first ``strategy.run`` (and everything before it) is checked call by call, as with
the check on. Once its closing handshake has passed, a data collective sends nothing of its own:
each rank records its number, kind and arguments' code (structure, dtypes, shapes, reduce op),
and the next handshake sent carries a hash of the step's records, in order: ``apply_gradients``'
(always sent), ``strategy.run``'s closing one (sent when something is unchecked), or any control
handshake. So a divergence raises on every rank by the end of the step, naming the first
collective in which the ranks differed, and every rank is back to checking call by call until
the next closing handshake passes.

Whether a call sends is decided only from what every rank shares (the phase, agreed at a
handshake), never from the call's own arguments: ranks whose arguments differ still make the
same calls. A divergence MPI reports in the transfer is raised where it does (see
:mod:`.failure`). A divergence that stops the transfer itself (ranks in collectives of different
sizes) is named by the watchdog from the flight records, where each unchecked collective has its
entry.

>>> from mpi4py import MPI
>>> from mpistrat import CommunicationOptions
>>> from mpistrat.collectives import Collectives
>>> ones = Collectives(MPI.COMM_SELF.Dup(), CommunicationOptions(check="step"))  # one rank: learned
>>> ones.all_reduce("sum", 1.0), ones.all_reduce("sum", 2.0)
(np.float64(1.0), np.float64(2.0))
>>> ones.step_check.record, ones.handshakes  # (number, kind, code) each; creation's handshake
([1, 'all_reduce', ..., 2, 'all_reduce', ...], 1)
>>> ones.agree("check now"); ones.step_check.record, ones.handshakes
([], 2)
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

from mpi4py import MPI

from mpistrat import config
from mpistrat.collectives.fingerprint import hash64
from mpistrat.collectives.mismatch import by_rank
from mpistrat.diagnostics.monitor import Monitor, PythonMonitor
from mpistrat.errors import CollectiveMismatchError

__all__ = [
    "LIMIT",
    "MASK",
    "CompiledMonitor",
    "CompiledStepCheck",
    "PythonStepCheck",
    "StepCheck",
    "chosen",
    "describe",
    "kind_code",
    "monitor_twin",
    "native_step",
    "twin",
]

LIMIT = 3 * 4096  # the record's length at most (4096 collectives): the next one sends a handshake
_KINDS = 4096  # kinds' codes remembered at most (a kind may name a variable: a program may make many)
MASK = (1 << 62) - 1  # codes are 62-bit: the handshake's slots also hold their negations


def kind_code(kinds: dict[str, int], kind: str) -> int:
    """The code of collective ``kind`` in the record, remembered in ``kinds`` (a kind's first
    unchecked call: ``defer`` reads it there from then on)."""
    if len(kinds) >= _KINDS:
        kinds.clear()
    code = kinds[kind] = hash64(kind)
    return code


class PythonStepState:
    """The state every unchecked call reads, and its two methods: the compiled
    ``native_step.StepState``'s Python twin, the reference (``native_step.c`` does the same)."""

    __slots__ = ("coder", "kinds", "learning", "limit", "record")

    def __init__(self, limit: int, coder: Callable[[dict[str, int], str], int]) -> None:
        self.learning = True  # until a step's closing handshake passes: every collective sends
        self.record: list[Any] = []  # appended to by defer, to limit
        self.limit = limit
        self.kinds: dict[str, int] = {}  # each kind's code, for the record (a plain dict: read per call)
        self.coder = coder  # coder(kinds, kind): a kind's first code, remembered in kinds

    def defer(self, seq: int, kind: str, fingerprint: int) -> bool:
        """Once the first step was checked (not learning): record data collective #``seq``,
        ``kind``, unchecked (True: the caller numbers it and sends nothing); else do nothing (False).

        ``agree_within(..., deferrable=True)`` defers through it; a caller that has nothing else to
        check (no error, the strategy's options) may call it first and skip the handshake's arguments.
        """
        record = self.record
        if self.learning or len(record) >= self.limit:
            return False
        code = self.kinds.get(kind) or self.coder(self.kinds, kind)
        # Its number too: a call that took a number and left no record (bad input raised on one rank, a
        # call with the check off) shifts the pairing of the calls after it.
        record += (seq, kind, code ^ fingerprint)
        return True

    def record_code(self) -> int:
        """The hash of the record's numbers and codes (ints hash alike on every rank)."""
        record = self.record
        return hash((tuple(record[0::3]), tuple(record[2::3])))


class StepCheck:
    """One communicator's phase (``learning``: every call sends) and record of unchecked collectives,
    over one twin's state: :class:`PythonStepCheck` or :class:`CompiledStepCheck` (the same methods).

    ``record``: each unchecked collective's number, kind and code (its kind's code ^ its
    fingerprint), flat and in order (three appends per call: every data collective's path), at
    most ``LIMIT`` long. The flight recorder shows it (``Flight.step``): a hang's diagnosis says
    what it holds.
    """

    __slots__ = ()

    if TYPE_CHECKING:  # each twin's state
        record: list[Any]

        @property
        def learning(self) -> bool: ...

        @learning.setter
        def learning(self, value: bool) -> None: ...

        def defer(self, seq: int, kind: str, fingerprint: int) -> bool: ...

        def record_code(self) -> int: ...

    def code(self) -> int:
        """The code of the unchecked collectives (0: none) that the next handshake carries."""
        return self.record_code() & MASK if self.record else 0

    def learned(self) -> None:
        """A step's closing handshake passed on every rank: repeats may go unchecked from here."""
        self.learning = False

    def verified(self) -> None:
        """A handshake carried the code and every rank agreed: nothing is unchecked any more."""
        self.record.clear()

    def raise_first_difference(self, comm: MPI.Intracomm) -> None:
        """After a failed handshake, on every rank: raise if the unchecked collectives differed.

        Returns (on every rank alike) when they did not: the handshake's own call differed. Either
        way the record is reported, and the ranks start over in the learning phase.
        """
        record = self.record
        entries = zip(record[0::3], record[1::3], record[2::3], strict=True)  # (seq, kind, code)
        records = comm.allgather(list(entries))
        self.verified()
        self.learning = True  # every rank checks call by call again, until a step closes cleanly
        if all(r == records[0] for r in records[1:]):
            return
        _raise_first(records)


def _raise_first(records: list[list[tuple[int, str, int]]]) -> NoReturn:
    for i in range(max(map(len, records))):
        entries = [r[i] if i < len(r) else None for r in records]
        if any(e != entries[0] for e in entries):
            seq = min(e[0] for e in entries if e is not None)
            numbered = len({e[0] for e in entries if e is not None}) > 1  # a call some ranks numbered apart
            what = by_rank(
                [
                    "no collective"
                    if e is None
                    else f"{e[1]}{f' #{e[0]}' if numbered else ''} [fp {e[2] & 0xFFFFFFFF:08x}]"
                    for e in entries
                ]
            )
            raise CollectiveMismatchError(
                f"collective #{seq} ran unchecked (MPISTRAT_CHECK=step) and the ranks were not in the "
                f"same collective with the same arguments: {what}. Its result and everything after it "
                "in this step is unreliable. Every rank must call the same collectives, with the same "
                "structures, dtypes and shapes, in the same order; run with MPISTRAT_CHECK=1 to stop at "
                "the call itself."
            )
    raise AssertionError("the records differ")  # unreachable: some entry differs


class PythonStepCheck(StepCheck, PythonStepState):
    """The step check over its Python state."""

    __slots__ = ()

    def __init__(self) -> None:
        PythonStepState.__init__(self, LIMIT, kind_code)


def _load() -> ModuleType | None:
    try:
        import mpistrat.collectives.native_step as module
    except ImportError:
        return None
    return module


# The compiled twins (native_step.c), where ``pip install .`` built them (it goes on without a C
# compiler); strategies use them where built and MPISTRAT_NATIVE is on (the default; read once).
native_step = _load()
chosen = native_step is not None and bool(config.read("MPISTRAT_NATIVE"))


def describe() -> str:
    """Which twin strategies use: ``compiled``, or ``Python`` and why (``mpistrat info`` shows it).

    >>> describe() in ("compiled", "Python (not built)", "Python (MPISTRAT_NATIVE=0)")
    True
    """
    if chosen:
        return "compiled"
    return "Python (not built)" if native_step is None else "Python (MPISTRAT_NATIVE=0)"


if TYPE_CHECKING or native_step is None:
    CompiledStepCheck: type[StepCheck] | None = None  # not built: the Python twin runs
    CompiledMonitor: type[Monitor] | None = None
else:

    class CompiledStepCheck(StepCheck, native_step.StepState):
        """The step check over its compiled state (``native_step.c``)."""

        __slots__ = ()

        def __init__(self) -> None:
            native_step.StepState.__init__(self, LIMIT, kind_code)

    class CompiledMonitor(Monitor, native_step.Marks):
        """A monitor over the compiled twin of its marks, which the compiled closing writes."""


# The twin a ``Collectives`` makes under ``MPISTRAT_CHECK=step``: compiled where it was built and
# ``MPISTRAT_NATIVE`` is on; a test may set either.
twin: type[StepCheck] = CompiledStepCheck if CompiledStepCheck and chosen else PythonStepCheck


def monitor_twin() -> type[Monitor]:
    """The monitor a ``Collectives`` makes: over the compiled marks where its step check would run
    the compiled twin (``twin``), the compiled closing's; else over the Python marks."""
    return CompiledMonitor if CompiledMonitor is not None and twin is CompiledStepCheck else PythonMonitor
