"""Explain a failed handshake: which collective, which leaf, and what each rank passed.

Runs only after the handshake found a disagreement, on every rank at once: one
``allgather`` of each rank's description, then the same exception everywhere. (The
codes the handshake compares come from :mod:`.fingerprint`, on every call.)

>>> print(by_rank(["float64 (3,)", "float64 (4,)", "float64 (3,)"]))
ranks 0, 2: float64 (3,); rank 1: float64 (4,)
"""

from __future__ import annotations

from typing import Any, NoReturn

import optree
from mpi4py import MPI

from mpistrat import nest
from mpistrat.comm import packing
from mpistrat.diagnostics.callsite import call_site
from mpistrat.errors import (
    CollectiveMismatchError,
    MergeCallError,
    MpistratError,
    StructureMismatchError,
    portable,
)
from mpistrat.log import ANY_RANK, logger
from mpistrat.reduce_op import ReduceOp
from mpistrat.values import local_copy

__all__ = ["by_rank", "describe", "first_difference", "raise_disagreement", "rank_list"]


def rank_list(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5`` (runs of consecutive ranks shortened).

    >>> rank_list([0, 1, 2, 5])
    'ranks 0-2, 5'
    """
    ranks = sorted(ranks)
    runs: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        if start == prev:
            runs.append(str(start))
        else:
            runs.append(f"{start}, {prev}" if prev == start + 1 else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def by_rank(values: list[str]) -> str:
    """What each rank had, ranks with the same value grouped (short even with many ranks)."""
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    return "; ".join(f"{rank_list(ranks)}: {v}" for v, ranks in groups.items())


def _shape(shape: tuple[Any, ...] | None) -> str:
    if shape is None:
        return ""
    inner = ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "")
    return f" shape ({inner})"


def describe(
    value: Any,
    op: ReduceOp | None,
    axis: Any = None,
    implementation: str | None = None,
    bytes_per_pack: int = 0,
) -> dict[str, Any]:
    """What this rank passed, per leaf; for all_gather the (free) axis dim shows as ``*``.

    Never raises (it runs when ranks already disagree): a nest too deep to walk is
    described as one entry saying so.
    """
    leaves: list[tuple[str, str, Any]] = []
    try:
        pairs = nest.flatten_with_paths(value)
        structure = str(nest.tree_structure(value))
    except RecursionError:
        depth = getattr(optree, "MAX_RECURSION_DEPTH", 1000)
        pairs, structure = [], f"<a nest deeper than {depth} levels>"
        leaves.append(("<root>", f"a nest deeper than {depth} levels", None))
    except Exception as exc:  # a description must not raise
        pairs, structure = [], f"<undescribable: {type(exc).__name__}: {exc}>"
        leaves.append(("<root>", structure, None))
    for path, leaf in pairs:
        try:
            arr = packing.as_array(local_copy(leaf))
            shape: tuple[Any, ...] = tuple(arr.shape)
            if isinstance(axis, int) and arr.ndim and -arr.ndim <= axis < arr.ndim:
                shape = tuple("*" if d == axis % arr.ndim else n for d, n in enumerate(shape))
            leaves.append((nest.path_str(path), packing.dtype_name(arr), shape))
        except MpistratError:
            leaves.append((nest.path_str(path), type(leaf).__name__, None))
    return {
        "reduce_op": None if op is None else op.value,
        "axis": axis,
        "implementation": implementation,
        "bytes_per_pack": bytes_per_pack,
        "leaves": leaves,
        "structure": structure,
    }


def first_difference(descriptions: list[Any]) -> str:
    """Name the first thing that differs between ranks' descriptions, and what each rank passed."""
    if not all(isinstance(d, dict) for d in descriptions):
        return "ranks passed different arguments: " + by_rank([repr(d) for d in descriptions])
    for key in ("reduce_op", "axis", "bytes_per_pack"):
        seen = [repr(d.get(key)) for d in descriptions]
        if len(set(seen)) > 1:
            return f"ranks passed different {key}: {by_rank(seen)}. Every rank must pass the same {key}."
    gather = descriptions[0].get("axis") is not None
    leaves = [d.get("leaves", []) for d in descriptions]
    for i in range(max(map(len, leaves))):
        entries = [ls[i] if i < len(ls) else None for ls in leaves]
        if any(e != entries[0] for e in entries):
            path = next(e[0] for e in entries if e is not None)
            what = by_rank(["no such leaf" if e is None else f"{e[0]} {e[1]}{_shape(e[2])}" for e in entries])
            advice = descriptions[0].get("advice") or (
                "Every rank must pass the same nest structure, dtypes and shapes"
                + (" (all dims but axis)." if gather else ".")
            )
            return f"the arguments differ at leaf {path}: {what}. {advice}"
    implementations = [str(d.get("implementation")) for d in descriptions]
    if len(set(implementations)) > 1:
        # The implementation is described where it decides the route: device arrays, or HIERARCHICAL.
        return (
            "ranks asked for different CommunicationOptions.implementation: "
            f"{by_rank(implementations)}. Every rank must use the same implementation"
            + (" (None: plain MPI)." if "None" in implementations else ".")
        )
    structures = [d.get("structure", "") for d in descriptions]
    if len(set(structures)) > 1:
        return f"the nest structures differ: {by_rank(structures)}. Every rank must pass the same structure."
    return "ranks passed different arguments: " + by_rank([repr(d) for d in descriptions])


def _raise_if_one_failed_and_left(
    comm: MPI.Intracomm,
    reports: list[Any],
    failed: list[tuple[int, BaseException]],
    error: BaseException | None,
) -> None:
    """The failing ranks' error on every rank, when exactly they are in another collective than the
    rest: they failed, and left (the rest never learns of it otherwise, and would read the
    consequence, "different collectives", as the cause). A ``sys.exit`` ends every rank with its status."""
    erred = dict(failed)
    mine = {(k, s) for r, (k, s, *_) in enumerate(reports) if r in erred}
    others = {(k, s) for r, (k, s, *_) in enumerate(reports) if r not in erred}
    if not failed or len(mine) != 1 or len(others) != 1:
        return
    (kind, seq), (where, at) = mine.pop(), others.pop()
    if (kind, seq) == (where, at):
        return
    first, rest = failed[0][1], [r for r in range(len(reports)) if r not in erred]
    code = first.code if isinstance(first, SystemExit) else None
    exiting = isinstance(first, SystemExit)
    cause = f"sys.exit({code!r})" if exiting else str(first).removeprefix(f"{kind}: ")
    text = (
        f"{kind} (collective #{seq}) failed on {rank_list(list(erred))}, which left {where} (collective "
        f"#{at}, called at {reports[rest[0]][4]}) where {rank_list(rest)} waited: {cause}"
    )
    if exiting:  # that rank ends its program: so does every rank, with its status
        if comm.Get_rank() == rest[0]:
            logger.error(f"{text}; every rank exits with its status", extra=ANY_RANK)
        raise SystemExit(code)
    raise _same_type(first, text) from error


def _same_type(error: BaseException, message: str) -> BaseException:
    try:
        if isinstance(error, OSError) and error.errno is not None:  # keep what a caller may test
            return type(error)(error.errno, message)
        return type(error)(message)
    except Exception:
        return MergeCallError(f"{type(error).__qualname__}: {message}")


def raise_disagreement(
    comm: MPI.Intracomm, kind: str, seq: int, describe: Any, error: BaseException | None
) -> NoReturn:
    """Every rank is here after a failed handshake: exchange descriptions, raise the same error everywhere.

    Order of blame: a rank that failed and so left the others' collective (an every-rank
    ``merge_fn`` that raised on it, or called ``sys.exit``: it went on to merge_call's closing
    handshake while the others are in a collective inside ``merge_fn``), then any other rank's
    failure while the ranks were in different collectives (an exception in ``strategy.run``), then
    ranks in different collectives, then a rank's own bad input, then the first differing argument.
    """
    try:
        mine = describe() if error is None else None
    except Exception as exc:  # a description must never turn an error into a hang
        mine = f"<undescribable: {exc}>"
    reports = comm.allgather((kind, seq, mine, None if error is None else portable(error), call_site()))
    name = f"{kind} (collective #{seq})"
    failed = [(r, e) for r, (_, _, _, e, _) in enumerate(reports) if e is not None]
    _raise_if_one_failed_and_left(comm, reports, failed, error)
    if len({(k, s) for k, s, *_ in reports}) > 1:
        calls = by_rank([f"{k} (collective #{s}) at {site}" for k, s, _, _, site in reports])
        if failed:  # a rank failed (an exception in strategy.run) while the others went on: that is the news
            r, first = failed[0]
            at = f"{reports[r][0]} (collective #{reports[r][1]})"
            text = str(first).removeprefix(f"{reports[r][0]}: ")
            raise _same_type(
                first,
                f"{at} failed on {rank_list([q for q, _ in failed])}: {text} (the ranks were in different "
                f"collectives then: {calls})",
            ) from error
        skipped = len({s for _, s, *_ in reports}) > 1
        raise CollectiveMismatchError(
            f"ranks are in different collectives: {calls}. "
            + (
                "Some ranks have made more collective calls than others (one skipped or repeated one). "
                if skipped
                else ""
            )
            + "Every rank must call the same collectives in the same order."
        )
    if failed:
        first = failed[0][1]
        text = str(first).removeprefix(f"{kind}: ")
        raise _same_type(first, f"{name} failed on {rank_list([r for r, _ in failed])}: {text}") from error
    sites = [site for *_, site in reports]
    where = sites[0] if len(set(sites)) == 1 else by_rank(sites)
    descriptions = [d for _, _, d, _, _ in reports]
    error_type = StructureMismatchError if _structures_differ(descriptions) else CollectiveMismatchError
    raise error_type(f"{name}, called at {where}: {first_difference(descriptions)}")


def _structures_differ(descriptions: list[Any]) -> bool:
    """Whether the ranks' nests differ in structure (tf's regroup asserts there), not only in leaves."""
    structures = {d.get("structure") for d in descriptions if isinstance(d, dict)}
    return len(structures) > 1 and None not in structures
