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

from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

from mpi4py import MPI

from mpistrat.collectives.fingerprint import hash64
from mpistrat.collectives.mismatch import by_rank
from mpistrat.collectives.native import native_step
from mpistrat.errors import CollectiveMismatchError

__all__ = ["LIMIT", "MASK", "StepCheck", "StepState", "defer", "record_code"]

LIMIT = 3 * 4096  # the record's length at most (4096 collectives): the next one sends a handshake
_KINDS = 4096  # kinds' codes remembered at most (a kind may name a variable: a program may make many)
MASK = (1 << 62) - 1  # codes are 62-bit: the handshake's slots also hold their negations


class PythonStepState:
    """The fields every unchecked call reads: the compiled ``native_step.StepState``'s Python twin."""

    __slots__ = ("kinds", "learning", "limit", "record")

    def __init__(self, record: list[Any], limit: int) -> None:
        self.learning = True  # until a step's closing handshake passes: every collective sends
        self.record = record  # appended to by defer, to limit
        self.limit = limit
        self.kinds: dict[str, int] = {}  # each kind's code, for the record (a plain dict: read per call)


def python_record_code(record: list[Any]) -> int:
    """The hash of the record's numbers and codes (``native_step.record_code``'s Python twin)."""
    return hash((tuple(record[0::3]), tuple(record[2::3])))  # ints hash alike on every rank


def python_defer(step: StepCheck | None, seq: int, kind: str, fingerprint: int) -> bool:
    """Under ``MPISTRAT_CHECK=step``, once the first step was checked (``step`` not learning): record
    data collective #``seq``, ``kind``, unchecked (True: the caller numbers it and sends nothing);
    else do nothing (False). ``defer`` is this or its compiled twin (:mod:`.native`).

    ``agree_within(..., deferrable=True)`` defers through it; a caller that has nothing else to
    check (no error, the strategy's options) may call it first and skip the handshake's arguments.
    """
    if step is None or step.learning:
        return False
    record = step.record
    if len(record) >= step.limit:
        return False
    kind_code = step.kinds.get(kind) or step.kind_code(kind)
    # Its number too: a call that took a number and left no record (bad input raised on one rank, a
    # call with the check off) shifts the pairing of the calls after it.
    record += (seq, kind, kind_code ^ fingerprint)
    return True


if TYPE_CHECKING:  # the twins alike
    StepState: TypeAlias = PythonStepState
    record_code = python_record_code
    defer = python_defer
else:  # the compiled ones where they run (mpistrat.collectives.native)
    StepState = PythonStepState if native_step is None else native_step.StepState
    record_code = python_record_code if native_step is None else native_step.record_code
    defer = python_defer if native_step is None else native_step.defer


class StepCheck(StepState):
    """One communicator's phase (``learning``: every call sends) and record of unchecked collectives.

    ``record``: each unchecked collective's number, kind and code (its kind's code ^ its
    fingerprint), flat and in order (three appends per call: every data collective's path), at
    most ``LIMIT`` long. It is the flight recorder's list (``Flight.unchecked``): a hang's
    diagnosis shows what it holds.
    """

    __slots__ = ()

    def __init__(self, record: list[Any]) -> None:
        super().__init__(record, LIMIT)

    def kind_code(self, kind: str) -> int:
        """The code of collective ``kind`` in the record, remembered in :attr:`kinds` (``defer``
        reads it there first: this is a kind's first unchecked call)."""
        if len(self.kinds) >= _KINDS:
            self.kinds.clear()
        code = self.kinds[kind] = hash64(kind)
        return code

    def code(self) -> int:
        """The code of the unchecked collectives (0: none) that the next handshake carries."""
        record = self.record
        return record_code(record) & MASK if record else 0

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
