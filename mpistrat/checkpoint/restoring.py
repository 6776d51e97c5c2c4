"""A restore: each rank reads what it will hold, the checksums are checked, then values are assigned.

Values every rank holds whole (mirrored variables, unsharded slots) are cut into windows: runs
of consecutive large entries in slices of at most ``WINDOW`` bytes, and batches of small ones.
Every rank reads 1/R of every window, then one ``Allgather`` per window, every rank sending as
much, puts it together: straight into the variables' own memory when the window lies end to
end there (a save lays an optimizer's flat buffers out in their order), else through a
temporary. A sharded slot's parts are read by the ranks that hold them, whatever
the rank count or sharding of the save. No rank reads the whole file, and nothing travels
from rank 0 but the table of contents.

Everything is read and every entry's checksum checked before the first value is assigned: a
damaged file is an error on every rank, with every variable as it was. The reads go in calls of
at most ``READ_CALL`` bytes, each checksummed in a thread while the next is read where the rank
has a core to spare, else right after it is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from mpistrat.checkpoint import mpiio
from mpistrat.checkpoint.crc import in_thread, records, spare_core
from mpistrat.checkpoint.format import Entry, Table, corrupt
from mpistrat.checkpoint.pieces import Piece, bytes_of, calls, joined, share, spans_of_share
from mpistrat.comm import packing
from mpistrat.errors import InvalidArgumentError
from mpistrat.interface.saved_entry import PARTS, POSITION, WHOLE, FlatMemory, SavedEntry

if TYPE_CHECKING:
    from mpistrat.checkpoint.local_copies import Copies
    from mpistrat.collectives import Collectives

__all__ = ["Index", "check_shapes", "load"]

Index = dict[str, tuple[np.dtype, tuple[int, ...]]]  # {entry: (dtype, shape)} of a file

SMALL = 1 << 20  # entries below this many bytes are gathered in batches, then copied into place
BATCH = 1 << 24  # bytes per batch of small entries: the temporary memory a restore needs
WINDOW = 1 << 26  # bytes per Allgather of large entries (into their memory, else a temporary)
READ_CALL = 1 << 23  # bytes per read: the checksum of one runs while the next is read


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
    targets: dict[str, SavedEntry],
    collectives: Collectives,
    writes_in_sync: Callable[[], AbstractContextManager[None]],
    hints: dict[str, str],
    method: str,
    copies: Copies | None = None,
) -> None:
    """Read the entries of ``table`` that ``targets`` (by name: ``interface/saved_entry.py``,
    shapes already checked) restore, check them, and assign them (collective; ``hints``:
    the MPI-IO hints the ranks agreed on; ``copies``: node-local copies to read instead of the file)."""
    wanted = [table.entries[n] for n in table.entries if n in targets]  # file order
    parted = {e.name: t for e in wanted if (t := targets[e.name]).holding == PARTS and not e.fortran}
    windows = _windows([e for e in wanted if e.name not in parted], collectives.size, _adjacent(targets))
    rank, size = collectives.rank, collectives.size
    parts = [
        (table.entries[n], at, part) for n, t in parted.items() for at, part in t.local_parts(writable=True)
    ]
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
    work: list[Future[list[tuple[str, int, int, int]]]] = []
    beside = spare_core(collectives.hosts, rank)

    def checksum_beside(call: list[Piece]) -> None:  # while the next call is read
        work.append(in_thread(lambda: records(call, table.checksum), beside))

    reading = calls(pieces, READ_CALL)
    if copies is not None:  # node-local copies: the ranks holding them serve every rank's reads
        error = copies.read(reading, collectives)
        for call in reading:
            checksum_beside(call)
    else:
        fh, error = mpiio.open_file(collectives.comm, table.path, MPI.MODE_RDONLY, hints)
        if fh is not None:
            error = mpiio.read(fh, reading, table.path, checksum_beside)
            with contextlib.suppress(MPI.Exception):
                fh.Close()
    try:
        mine = [record for done in work for record in done.result()]
    except Exception as exc:  # every rank must hear of it
        error, mine = error or mpiio.os_error(exc, "checksumming the checkpoint", table.path), []
    report = (None if error is None else str(error), mine)
    reports = collectives.gather_to_root(report, kind=f"checkpoint.{method} (checksums)")
    collectives.on_root(
        lambda: _verify(table, wanted, reports or [], method), kind=f"checkpoint.{method} (check)"
    )
    positions = {  # checked before anything is assigned: a dataset that changed is refused first
        name: (target, target.check(np.asarray(table.positions[name], np.int64)))
        for name, target in targets.items()
        if target.holding == POSITION and name in table.positions
    }
    with writes_in_sync():
        temporaries: dict[str, np.ndarray] = {}
        for window in windows:
            _gather(window, targets, collectives, f"checkpoint.{method} (gather)", temporaries)
        at = parts_at
        for entry, _, part in parts:
            host = staging[at : at + int(part.nbytes)].view(entry.dtype)
            part[...] = host if packing.array_module(part) is np else packing.array_module(part).asarray(host)
            at += int(part.nbytes)
        for target, saved in positions.values():
            target.apply(saved)


def _place(target: SavedEntry) -> tuple[FlatMemory, int, int] | None:
    """Where a whole entry lies in memory shared with others (None: not shared, or not whole)."""
    return target.place if target.holding == WHOLE else None


def _adjacent(targets: dict[str, SavedEntry]) -> Callable[[Entry, Entry], bool]:
    """Whether two entries' variables follow each other in one flat buffer (their bytes then go
    straight into it together)."""

    def adjacent(first: Entry, second: Entry) -> bool:
        a, b = _place(targets[first.name]), _place(targets[second.name])
        elements = first.nbytes // max(first.dtype.itemsize, 1)
        return a is not None and b is not None and a[0] is b[0] and b[2] == a[2] + elements

    return adjacent


def _windows(entries: list[Entry], size: int, adjacent: Callable[[Entry, Entry], bool]) -> list[_Window]:
    """Runs of consecutive large entries whose variables lie end to end cut into windows of at most
    ``WINDOW`` bytes, each a multiple of ``size`` (every rank then sends as much); small entries,
    and what is left at the end of a run, in batches of at most ``BATCH`` bytes."""
    out: list[_Window] = []
    batch = _Window([])

    def batched(entry: Entry, a: int, b: int) -> None:
        nonlocal batch
        if batch.ranges and batch.nbytes + b - a > BATCH:
            out.append(batch)
            batch = _Window([])
        batch.ranges.append((entry, a, b))

    run: list[Entry] = []
    for entry in [*entries, None]:
        if entry is not None and entry.nbytes >= SMALL:
            if run and not adjacent(run[-1], entry):
                _cut(run, size, out, batched)
                run = []
            run.append(entry)
            continue
        _cut(run, size, out, batched)
        run = []
        if entry is not None:
            batched(entry, 0, entry.nbytes)
    if batch.ranges:
        out.append(batch)
    return out


def _cut(run: list[Entry], size: int, out: list[_Window], batched: Callable[[Entry, int, int], None]) -> None:
    """Consecutive large entries as one stream of bytes: windows of ``WINDOW - WINDOW % size`` bytes,
    the last one a multiple of ``size``; the remaining fewer than ``size`` bytes to the batches."""
    step = WINDOW - WINDOW % size
    total = sum(e.nbytes for e in run)
    main, at, window = total - total % size, 0, _Window([])
    for entry in run:
        a = 0
        while a < entry.nbytes and at < main:
            take = min(entry.nbytes - a, step - window.nbytes, main - at)
            window.ranges.append((entry, a, a + take))
            a, at = a + take, at + take
            if window.nbytes == step or at == main:
                out.append(window)
                window = _Window([])
        if a < entry.nbytes:
            batched(entry, a, entry.nbytes)


def _verify(table: Table, wanted: list[Entry], reports: list[Any], method: str) -> None:
    """On rank 0: every rank read what it asked for, and every entry read checksums as saved."""
    failed = [(r, e) for r, (e, _) in enumerate(reports) if e is not None]
    if failed:
        rank, text = failed[0]
        raise corrupt(
            table.path, f"rank {rank} could not read it ({text}); was it changed while being restored?"
        )
    parts: dict[str, list[tuple[int, int, int]]] = {e.name: [] for e in wanted}
    for _, read in reports:
        for name, start, part, length in read:
            parts[name].append((start, part, length))
    bad = []
    for entry in wanted:
        data = table.checksum.joined(parts[entry.name], entry.nbytes)
        prefix, length = entry.prefix
        got = None if data is None else table.checksum.combine(prefix, data, entry.nbytes) if length else data
        if got is None or got != entry.crc:
            bad.append(entry.name)
    if bad:
        raise corrupt(table.path, f"checksum mismatch in {', '.join(bad)}: its bytes are not those saved")


def _gather(
    window: _Window,
    targets: dict[str, SavedEntry],
    collectives: Collectives,
    kind: str,
    temporaries: dict[str, Any],
) -> None:
    """Every rank's 1/R of ``window`` put together and into place: one ``Allgather(v)``, straight into
    the variables' memory when the window's ranges lie end to end there (a flat buffer's variables
    in the order they were saved), else into a temporary, then copied. An entry that cannot take
    bytes in place collects them in ``temporaries`` until it has all, then is assigned."""
    size = collectives.size
    counts = [b - a for a, b in (share(window.nbytes, size, r) for r in range(size))]
    assert window.mine is not None
    region = _flat_region(window, targets)
    if region is not None:
        collectives.all_gather_bytes(window.mine, region, counts, kind=kind)
        return
    with contextlib.ExitStack() as stack:
        dests = [
            stack.enter_context(_into(e, targets[e.name], temporaries, a, b)) for e, a, b in window.ranges
        ]
        together = joined(dests)
        if together is not None:
            collectives.all_gather_bytes(window.mine, together, counts, kind=kind)
            return
        out = np.empty(window.nbytes, np.uint8)
        collectives.all_gather_bytes(window.mine, out, counts, kind=kind)
        at = 0
        for dest in dests:
            dest[...] = out[at : at + dest.size]
            at += dest.size


def _flat_region(window: _Window, targets: dict[str, SavedEntry]) -> np.ndarray | None:
    """The bytes of one optimizer's flat buffer that ``window`` fills, claimed for an in-place write
    (copied first if something holds a view of it), when its ranges are that buffer's variables in
    order; else None."""
    places: list[tuple[FlatMemory, int, int]] = []
    for entry, _, _ in window.ranges:
        place = _place(targets[entry.name])
        if place is None or entry.fortran or place[0] is not (places[0][0] if places else place[0]):
            return None
        places.append(place)
    storage = places[0][0]
    if storage.dtype != window.ranges[0][0].dtype:
        return None
    array = storage.claim()
    if type(array) is not np.ndarray:  # a device buffer: through the host, entry by entry
        return None
    first, a, _ = window.ranges[0]
    start = places[0][2] * first.dtype.itemsize + a
    return bytes_of(array)[start : start + window.nbytes]


@contextlib.contextmanager
def _into(
    entry: Entry, target: SavedEntry, temporaries: dict[str, Any], a: int, b: int
) -> Iterator[np.ndarray]:
    """Where bytes ``[a, b)`` of ``entry`` go: ``target``'s own memory when it can take them as they
    are (a NumPy array of the entry's dtype, not a sync-on-read variable's), else a temporary, set
    into ``target`` once all of its bytes are in."""
    if target.holding == WHOLE and not entry.fortran:
        with target.memory() as array:
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
    value = data.view(entry.dtype).reshape(entry.shape, order="F" if entry.fortran else "C")
    if target.holding == WHOLE:
        target.assign(value)
    elif target.holding == POSITION:  # a format-1 file holds positions as entries
        target.apply(target.check(value))
    else:  # an earlier version's entry in Fortran order: this rank's parts of it
        flat = np.ascontiguousarray(value).reshape(-1)
        for element, part in target.local_parts(writable=True):
            host = flat[element : element + int(part.size)]
            part[...] = host if packing.array_module(part) is np else packing.array_module(part).asarray(host)


def check_shapes(what: str, entries: dict[str, SavedEntry], index: Index) -> None:
    """Refuse (naming them) the ``entries`` whose shape or dtype differ from the file's ``index``."""
    mismatched = [
        f"{n} ({v.mismatch(*index[n])})"
        if v.holding == POSITION
        else f"{n} (checkpoint: {index[n][0]}{list(index[n][1])}, here: {v.dtype}{list(v.shape)})"
        for n, v in entries.items()
        if n in index and (tuple(index[n][1]) != tuple(v.shape) or index[n][0] != v.dtype)
    ]
    if mismatched:
        advice = ""
        if any("/accumulation/" in m for m in mismatched):
            advice = (
                "; a gradient accumulation cycle saved part-way holds each rank's gradients, so it resumes "
                "only at the rank count it was saved at (the first dimension): restore there, or save "
                "between cycles (after the K-th apply_gradients), which restores at any rank count"
            )
        raise InvalidArgumentError(f"{what}: different shape or dtype: {'; '.join(mismatched)}{advice}")
