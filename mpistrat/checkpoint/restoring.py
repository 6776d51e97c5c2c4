"""A restore: each rank reads what it will hold, the checksums are checked, then values are assigned.

Values every rank holds whole (mirrored variables, unsharded slots) are cut into windows: each
large entry (in slices of at most ``WINDOW`` bytes) and each batch of small ones. Every rank
reads 1/R of every window, then one ``Allgatherv`` per window, every rank sending as much,
puts it together: straight into the variable's own memory for a large entry, through a
temporary for a batch. A sharded slot's parts are read by the ranks that hold them, whatever
the rank count or sharding of the save. No rank reads the whole file, and nothing travels
from rank 0 but the table of contents.

Everything is read and every entry's checksum checked before the first value is assigned: a
damaged file is an error on every rank, with every variable as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from mpistrat.checkpoint import crc, mpiio
from mpistrat.checkpoint.format import Entry, Table, corrupt
from mpistrat.checkpoint.pieces import Piece, bytes_of, calls, share, spans_of_share
from mpistrat.checkpoint.saving import ALWAYS
from mpistrat.comm import packing
from mpistrat.input.position import InputPosition
from mpistrat.training.optimizer_state import own_copy
from mpistrat.training.sharded_slot import ShardedSlot
from mpistrat.training.variables import Variable, VariableSynchronization, Writable

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["load"]

SMALL = 1 << 20  # entries below this many bytes are gathered in batches, then copied into place
BATCH = 1 << 24  # bytes per batch of small entries: the temporary memory a restore needs
WINDOW = 1 << 28  # bytes per Allgatherv straight into a large entry


@dataclasses.dataclass
class _Window:
    """Bytes of whole entries gathered by one ``Allgatherv``: ``(entry, start, stop)`` ranges."""

    ranges: list[tuple[Entry, int, int]]
    mine: np.ndarray | None = None  # this rank's 1/R of them, once read

    @property
    def nbytes(self) -> int:
        return sum(b - a for _, a, b in self.ranges)


def load(
    table: Table,
    targets: dict[str, Any],
    collectives: Collectives,
    writes_in_sync: Callable[[], AbstractContextManager[None]],
    io_hints: dict[str, str] | None,
    method: str,
) -> None:
    """Read the entries of ``table`` that ``targets`` (name: variable, sharded slot or dataset
    position, shapes already checked) restore, check them, and assign them (collective)."""
    wanted = [table.entries[n] for n in table.entries if n in targets]  # file order
    parted = [e for e in wanted if isinstance(targets[e.name], ShardedSlot) and not e.fortran]
    windows = _windows([e for e in wanted if e not in parted], collectives.size)
    rank, size = collectives.rank, collectives.size
    parts = [(e, element, part) for e in parted for element, part in targets[e.name].local_parts()]
    sizes = [share(w.nbytes, size, rank) for w in windows]
    staging = np.empty(sum(b - a for a, b in sizes) + sum(int(p.nbytes) for _, _, p in parts), np.uint8)
    pieces, at = [], 0
    for window, (lo, hi) in zip(windows, sizes, strict=True):
        window.mine = staging[at : at + hi - lo]
        for i, a, b in spans_of_share([b - a for _, a, b in window.ranges], lo, hi):
            entry, start, _ = window.ranges[i]
            pieces.append(Piece(entry.name, start + a, entry.offset + start + a, staging[at : at + b - a]))
            at += b - a
    parts_at = at
    for entry, element, part in parts:
        start = element * entry.dtype.itemsize
        pieces.append(Piece(entry.name, start, entry.offset + start, staging[at : at + int(part.nbytes)]))
        at += int(part.nbytes)
    mine = calls(pieces)
    rounds = collectives.agree(f"checkpoint.{method} (plan)", maximum=len(mine), options=ALWAYS)
    fh, error = mpiio.open_file(collectives.comm, table.path, MPI.MODE_RDONLY, mpiio.hints(io_hints))
    if fh is not None:
        error = mpiio.read_rounds(fh, mine, rounds, table.path)
        with contextlib.suppress(MPI.Exception):
            fh.Close()
    report = (
        None if error is None else str(error),
        [(p.entry, p.start, zlib.crc32(p.memory.data), p.nbytes) for call in mine for p in call],
    )
    reports = collectives.gather_to_root(report, kind=f"checkpoint.{method} (checksums)")
    collectives.on_root(
        lambda: _verify(table, wanted, reports or [], method), kind=f"checkpoint.{method} (check)"
    )
    with writes_in_sync():
        temporaries: dict[str, np.ndarray] = {}
        for window in windows:
            _gather(window, targets, collectives, f"checkpoint.{method} (gather)", temporaries)
        at = parts_at
        for entry, _, part in parts:
            host = staging[at : at + int(part.nbytes)].view(entry.dtype)
            part[...] = host if packing.array_module(part) is np else packing.array_module(part).asarray(host)
            at += int(part.nbytes)
        for name, target in targets.items():
            if isinstance(target, InputPosition) and name in table.positions:
                target.assign(np.asarray(table.positions[name], np.int64))


def _windows(entries: list[Entry], size: int) -> list[_Window]:
    """Large entries in slices of at most ``WINDOW`` bytes, each a multiple of ``size`` (every rank
    then sends as much); small entries, and what is left of large ones, in batches of at most ``BATCH``."""
    out: list[_Window] = []
    batch = _Window([])
    step = WINDOW - WINDOW % size
    for entry in entries:
        start = 0
        if entry.nbytes >= SMALL:
            start = entry.nbytes - entry.nbytes % size
            out.extend(_Window([(entry, a, min(a + step, start))]) for a in range(0, start, step))
        if start < entry.nbytes:
            if batch.ranges and batch.nbytes + entry.nbytes - start > BATCH:
                out.append(batch)
                batch = _Window([])
            batch.ranges.append((entry, start, entry.nbytes))
    if batch.ranges:
        out.append(batch)
    return out


def _verify(table: Table, wanted: list[Entry], reports: list[Any], method: str) -> None:
    """On rank 0: every rank read what it asked for, and every entry read checksums as saved."""
    failed = [(r, e) for r, (e, _) in enumerate(reports) if e is not None]
    if failed:
        rank, text = failed[0]
        raise corrupt(
            table.path, f"rank {rank} could not read it ({text}); was it changed while being restored?"
        )
    parts: dict[str, list[tuple[int, int, int]]] = {e.name: [] for e in wanted}
    for _, records in reports:
        for name, start, part, length in records:
            parts[name].append((start, part, length))
    bad = []
    for entry in wanted:
        data = crc.joined(parts[entry.name], entry.nbytes)
        prefix, length = entry.prefix
        got = None if data is None else crc.combine(prefix, data, entry.nbytes) if length else data
        if got is None or got != entry.crc:
            bad.append(entry.name)
    if bad:
        raise corrupt(table.path, f"checksum mismatch in {', '.join(bad)}: its bytes are not those saved")


def _gather(
    window: _Window, targets: dict[str, Any], collectives: Collectives, kind: str, temporaries: dict[str, Any]
) -> None:
    """Every rank's 1/R of ``window`` put together and into place: one ``Allgather(v)``. An entry that
    cannot take bytes in place collects them in ``temporaries`` until it has all, then is assigned."""
    size = collectives.size
    counts = [b - a for a, b in (share(window.nbytes, size, r) for r in range(size))]
    assert window.mine is not None
    if len(window.ranges) == 1:  # a slice of a large entry, straight into place
        entry, a, b = window.ranges[0]
        with _into(entry, targets[entry.name], temporaries, a, b) as dest:
            collectives.all_gather_bytes(window.mine, dest, counts, kind=kind)
        return
    out = np.empty(window.nbytes, np.uint8)
    collectives.all_gather_bytes(window.mine, out, counts, kind=kind)
    at = 0
    for entry, a, b in window.ranges:
        with _into(entry, targets[entry.name], temporaries, a, b) as dest:
            dest[...] = out[at : at + b - a]
        at += b - a


@contextlib.contextmanager
def _into(entry: Entry, target: Any, temporaries: dict[str, Any], a: int, b: int) -> Iterator[np.ndarray]:
    """Where bytes ``[a, b)`` of ``entry`` go: ``target``'s own memory when it can take them as they
    are (a NumPy variable of the entry's dtype, not sync-on-read), else a temporary, assigned to
    ``target`` once all of its bytes are in."""
    on_read = getattr(target, "synchronization", None) is VariableSynchronization.ON_READ
    if isinstance(target, Variable) and not on_read and not entry.fortran:
        with Writable(own_copy(target)) as array:
            if type(array) is np.ndarray and array.dtype == entry.dtype and array.flags.c_contiguous:
                yield bytes_of(array)[a:b]
                return
    data, missing = temporaries.get(entry.name, (None, entry.nbytes))
    if data is None:
        data = np.empty(entry.nbytes, np.uint8)
    yield data[a:b]
    missing -= b - a
    if missing:
        temporaries[entry.name] = (data, missing)
        return
    temporaries.pop(entry.name, None)
    target.assign(data.view(entry.dtype).reshape(entry.shape, order="F" if entry.fortran else "C"))
