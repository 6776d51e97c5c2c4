"""The texts of a diagnosis: who is missing from a collective and where each rank is instead.

Everything here turns what the side channel learnt (each rank's answer, as
``Monitor.state`` makes it) into prose: rank ranges (``ranks 0-2, 5``), the explanation
of one stall or timeout, the one-line pointer the ranks that do not print it get, and the
headlines of the watchdog's warnings and errors. Nothing here sends a message or acts.

>>> ranks([3])
'rank 3'
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from mpistrat.diagnostics import flight, stragglers
from mpistrat.diagnostics.callsite import call_site

if TYPE_CHECKING:
    from mpistrat.diagnostics.monitor import Monitor

__all__ = [
    "FINALIZED",
    "NO_SIDE_CHANNEL",
    "aborted",
    "departed",
    "died",
    "exit_reason",
    "explain",
    "first_difference",
    "headline",
    "on_hosts",
    "pointer",
    "ranks",
    "records",
    "stood_in",
    "timed_out",
    "undiagnosed",
    "warning",
]

NO_SIDE_CHANNEL = "which ranks are missing is unknown (MPI thread level is below MULTIPLE: no side channel)"
FINALIZED = "which ranks are missing is unknown (the strategy was finalized)"


def ranks(numbers: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5, 6``: runs of three or more are ranges, so a list of most of R
    ranks stays short.

    >>> ranks([6, 5, 0, 1, 2])
    'ranks 0-2, 5, 6'
    """
    ordered, runs = sorted(numbers), list[list[int]]()
    for r in ordered:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}-{b}" if b - a > 1 else ", ".join(map(str, range(a, b + 1))) for a, b in runs)
    return ("rank " if len(ordered) == 1 else "ranks ") + text


SHOWN_HOSTS = 4  # host names listed before "and N more"


def on_hosts(numbers: list[int], hosts: tuple[str, ...]) -> str:
    """`` on nodeb``: where ranks ``numbers`` run, when the strategy spans several hosts (``hosts``,
    every rank's host name; empty on one host, where it would say nothing new).

    >>> on_hosts([2, 3], ("a", "a", "b", "b")), on_hosts([0, 3], ("a", "a", "b", "b")), on_hosts([1], ())
    (' on b', ' on a, b', '')
    """
    names = sorted({hosts[r] for r in numbers if r < len(hosts)})
    if not names:
        return ""
    more = f" and {len(names) - SHOWN_HOSTS} more" if len(names) > SHOWN_HOSTS else ""
    return f" on {', '.join(names[:SHOWN_HOSTS])}{more}"


def first_difference(entries: dict[int, list[Any]], size: int) -> tuple[int, str] | None:
    """The first collective whose ``(seq, kind, fingerprint)`` entries (a flight record's, or the
    step check's record of unchecked collectives) differ between the ``size`` ranks, and what each
    had there, ranks grouped; None if they agree or a rank's are missing. Only the collectives
    every rank's entries still hold count (a flight record keeps its last few).

    >>> first_difference({0: [(4, "all_reduce", 1), (5, "x", 1)], 1: [(4, "all_reduce", 2)]}, 2)
    (4, 'rank 0: all_reduce [fp 00000001]; rank 1: all_reduce [fp 00000002]')
    >>> first_difference({0: [(4, "all_reduce", 1)], 1: [(4, "all_reduce", 1)]}, 2) is None
    True
    """
    if len(entries) < size:
        return None
    by_seq = [{e[0]: tuple(e) for e in entries[r]} for r in range(size)]
    held = [seqs for seqs in by_seq if seqs]
    since = max((min(seqs) for seqs in held), default=0)  # older ones fell out of some rank's record
    for seq in sorted(set().union(*by_seq)):
        if seq < since:
            continue
        here = [b.get(seq) for b in by_seq]
        if any(e != here[0] for e in here):
            groups: dict[str, list[int]] = {}
            for r, e in enumerate(here):
                groups.setdefault(
                    "no collective" if e is None else f"{e[1]} [fp {e[2] & 0xFFFFFFFF:08x}]", []
                ).append(r)
            return seq, "; ".join(f"{ranks(rs)}: {what}" for what, rs in groups.items())
    return None


def _where(rank: int, answer: dict[str, Any], hosts: tuple[str, ...]) -> str:
    name = f"rank {rank}" if answer["world"] == rank else f"rank {rank} (world {answer['world']})"
    name += on_hosts([rank], hosts)
    if answer["waited"] is not None:
        return f"{name} is in {answer['kind']} (collective #{answer['seq']}) at {answer['site']}"
    last = answer["last"]
    done = "no collective yet" if last is None else f"last finished {last[0]} #{last[1]} {last[2]:.1f} s ago"
    return f"{name} is not in a collective ({done}); it is at {answer['site']}"


def _silent(numbers: list[int], listened: float, hosts: tuple[str, ...]) -> str:
    """The ranks that did not answer: slow (oversubscribed, in a long MPI call) is not gone."""
    why = "slow to answer, or killed, or blocked outside Python"
    return f"{ranks(numbers)}{on_hosts(numbers, hosts)} did not answer within {listened:.0f} s ({why})"


def explain(
    seq: int,
    kind: str,
    answers: dict[int, dict[str, Any]],
    size: int,
    known: set[int],
    listened: float,
    hosts: tuple[str, ...] = (),
) -> tuple[str, list[int]]:
    """Who is missing from collective ``seq`` (``kind``), by the answers; ``known`` ranks wait in it too.
    ``hosts`` (every rank's host, see :func:`on_hosts`) says where the missing ranks run.

    Returns the explanation and the ranks waiting in the collective. A rank that did not answer
    within ``listened`` seconds is named once, with the others, not reported as gone.
    """
    waiting = sorted(
        known
        | {r for r, a in answers.items() if a["waited"] is not None and a["seq"] == seq and a["kind"] == kind}
    )
    if not waiting:
        return "no rank is waiting in it any more", []
    missing = [r for r in range(size) if r not in waiting]
    if not missing:
        return "every rank is in it now", waiting
    if any(a.get("agreed") and a["seq"] == seq and a["kind"] == kind for a in answers.values()):
        # A rank past this collective's opening handshake (an all-reduce) proves every rank entered
        # it. A rank busy inside it may answer late: MPI can hold up the watchdog's messages while
        # the main thread transfers (measured: over 1 s in a 900 MiB all_gather at 3 ranks).
        silent = [r for r in missing if r not in answers]
        done = [r for r in missing if r in answers]
        text = (
            "every rank has entered it (its opening handshake completed): a long transfer, not a missing rank"
        )
        if silent:
            who = ranks(silent) + on_hosts(silent, hosts)
            text += f"; {who} did not answer within {listened:.0f} s (busy inside it)"
        if done:
            text += f"; {'; '.join(_where(r, answers[r], hosts) for r in done)} (finished it)"
        return text, waiting
    absent, silent = [r for r in missing if r in answers], [r for r in missing if r not in answers]
    lines = [_where(r, answers[r], hosts) for r in absent] + (
        [_silent(silent, listened, hosts)] if silent else []
    )
    return (
        f"waiting for {ranks(absent or silent)}: {'; '.join(lines)}. Waiting in it: {ranks(waiting)}",
        waiting,
    )


def stood_in(rank: int) -> str:
    """What ends a diagnosis made by ``rank`` > 0 (reports reach it after ranks 0 to rank-1 did not reply)."""
    passed = "rank 0" if rank == 1 else f"ranks 0 to {rank - 1}"
    return f" ({passed} did not answer as the watchdog's coordinator; rank {rank} stood in)"


def pointer(speaker: int) -> str:
    """What the ranks that do not print a diagnosis say instead (O(1) bytes each, not O(R))."""
    return f"rank {speaker} prints who is missing"


def records(mon: Monitor, answers: dict[int, dict[str, Any]]) -> str:
    """Every rank's flight record (from the answers), to end a diagnosis."""
    owner = mon.owner()
    kept = (owner.flight.maxlen or 0) if owner is not None and hasattr(owner, "flight") else 0
    if not kept:
        return ""
    return flight.block({r: a.get("flight") for r, a in answers.items()}, mon.size, kept)


def headline(mon: Monitor) -> str:
    """The collective ``mon`` is in, and where the program called it."""
    frame = sys._current_frames().get(mon.thread) if mon.thread else None
    site = call_site(frame) if frame is not None else "<unknown>"
    return f"{mon.kind} (collective #{mon.seq}, called at {site})"


def warning(mon: Monitor, waited: float, result: str) -> str:
    """The stall warning: ``result`` is the diagnosis (flight records last)."""
    explanation, kept = flight.split(result)
    late = stragglers.note(getattr(mon.owner(), "stragglers", None))
    return (
        f"{headline(mon)} has waited {waited:.0f} s: {explanation}. "
        + (f"Before it, {late}. " if late else "")
        + "(MPISTRAT_STALL_WARNING_SECONDS sets when this warning comes; MPISTRAT_TIMEOUT ends the job.)"
        + kept
    )


def departed(mon: Monitor, rank: int, last: int, why: str) -> str:
    """Why the collective ``mon`` is in cannot complete: ``rank`` exited after collective ``last``."""
    where = on_hosts([rank], mon.hosts)
    return f"{headline(mon)} cannot complete: rank {rank}{where} exited after collective #{last} ({why})"


def died(mon: Monitor, rank: int, why: str, world: int) -> str:
    """Why the collective ``mon`` is in cannot complete: ``rank`` (world rank ``world``) died, as
    ``why`` says; with the optimizer step this rank is at."""
    name = f"rank {rank}" if world == rank else f"rank {rank} (world rank {world})"
    steps = getattr(mon.owner(), "commits", None)
    at = "" if steps is None else f" during optimizer step {steps + 1} (this rank had applied {steps})"
    return f"{name}{on_hosts([rank], mon.hosts)} died{at}: {why}; {headline(mon)} cannot complete"


def undiagnosed(patience: float) -> str:
    """The diagnosis of a timeout that did not come ``patience`` seconds after its deadline."""
    return (
        f"which ranks are missing is unknown (no diagnosis came within {patience:g} s: "
        "the ranks asked to make one did not answer)"
    )


def timed_out(mon: Monitor, timeout: float, explanation: str) -> str:
    """The collective ``mon`` is in timed out after ``timeout`` s; ``explanation``: who is missing."""
    default = "" if mon.polled else " (MPISTRAT_TIMEOUT's default; set it to change this, 0 to disable)"
    return f"{headline(mon)} did not complete within its timeout of {timeout:g} s{default}: {explanation}"


def aborted(problem: str) -> str:
    """The message the job ends with: ``problem``, then the ranks' flight records (last)."""
    problem, kept = flight.split(problem)
    return (
        f"{problem}. The job is aborted: a collective left half-done leaves the communicator unusable.{kept}"
    )


def exit_reason() -> str:
    """Why this process exits, for the ranks that wait for it."""
    error = getattr(sys, "last_value", None)  # an uncaught exception ended the program
    if error is not None:
        return f"an uncaught {type(error).__name__}"
    return "sys.exit or the end of its program"
