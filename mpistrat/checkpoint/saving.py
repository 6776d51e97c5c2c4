"""A save: every rank writes its share of one file, then rank 0 names it (collective).

:func:`begin` agrees on what is saved, lays the file out (:mod:`~mpistrat.checkpoint.format`) and
picks this rank's pieces (:mod:`~mpistrat.checkpoint.pieces`); rank 0 names the temporary file and
every rank creates it together. Then either :func:`write` writes the pieces with MPI-IO at once and
flushes them (their CRC-32C computed in a thread meanwhile: beside the writes where the rank has a
core to spare, else while the flush waits for the disk), or
:mod:`~mpistrat.checkpoint.background` copies them aside and a thread writes them while training
goes on. :func:`finish` (every rank, after either) gathers the errors and the checksums; rank 0
writes the final header, flushes it, renames the file into place and records it in the directory's
index. Any rank's error, at any step, is raised on every rank there, and the temporary file is
removed: the previous checkpoint stays as it was.

Each rank writes its share of the values every rank holds from its own copy, so the ranks
compare their copies: each checksums the rest of its copy too (in the same thread), and rank 0
refuses the file if the copies' checksums differ.

Memory: a save copies nothing of a NumPy array (MPI-IO writes from it), a device array's
share through the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from mpistrat import config
from mpistrat.checkpoint import crc, files, mpiio
from mpistrat.checkpoint.crc import CRC32C, records
from mpistrat.checkpoint.format import Table, dtype_code, encode_header, header_rows, lay_out
from mpistrat.checkpoint.pieces import Piece, bytes_of, share, spans_of_share
from mpistrat.collectives.fingerprint import hash64
from mpistrat.collectives.handshake import check_enabled
from mpistrat.comm import packing
from mpistrat.errors import CollectiveMismatchError, InvalidArgumentError, MpistratError
from mpistrat.interface.saved_entry import PARTS, POSITION, PartsEntry, SavedEntry, WholeEntry
from mpistrat.options import CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = [
    "ALWAYS",
    "Save",
    "abandon",
    "begin",
    "close",
    "copies_of",
    "finish",
    "local_copies_described",
    "write",
]

# Checkpoint agreements run even with the check off: a rank that failed must not be waited for.
ALWAYS = CommunicationOptions(check=True)


@dataclasses.dataclass
class Save:
    """One save in progress on this rank."""

    method: str  # "save" or "write", for messages
    path: str  # rank 0's: where the file goes
    tmp: str  # rank 0's temporary name, written by every rank
    table: Table
    header: bytes  # rank 0 writes it first, with every checksum 0 (the file is then recognisably ours)
    metadata: dict[str, str]
    calls: list[list[Piece]]  # this rank's pieces, grouped into its collective write calls
    rounds: int  # collective write calls: the most any rank makes
    compared: list[str]  # the values every rank holds whose copies the ranks compare
    others: list[Piece]  # the bytes of those values this rank does not write, checksummed to compare
    listing: files.Listing | None  # what rank 0 records in the directory's index once the file is in place
    in_place: Callable[[], None]  # what every rank runs once the file is in place
    keep: list[Any]  # arrays the pieces view (device copies, aggregated values)
    file: Any = None  # the open MPI file, between begin and write
    error: OSError | None = None
    # (entry, start, CRC-32C, length) of each piece written, and of ``others``: once checksummed
    crcs: list[tuple[str, int, int, int]] = dataclasses.field(default_factory=list)
    other_crcs: list[tuple[str, int, int, int]] = dataclasses.field(default_factory=list)
    thread: threading.Thread | None = None
    seconds: float | None = None  # how long a background writer took to write and checksum this rank's share

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.table.entries.values()) + len(self.header)


def begin(
    entries: dict[str, SavedEntry],
    collectives: Collectives,
    path: str,
    method: str,
    counter: int,
    io_hints: dict[str, str] | None,
    listing: files.Listing | None = None,
    in_place: Callable[[], None] = lambda: None,
) -> Save:
    """Agree on ``entries`` (by name: ``interface/saved_entry.py``) and the MPI-IO hints, lay the
    file out, create it (collective). Errors found on any rank are raised on every rank before
    anything is written."""
    hints = mpiio.hints(io_hints)  # part of the plan: ranks that open a file with other hints may hang
    described: list[Any] = [(n, str(v.dtype), v.shape) for n, v in entries.items()]
    described.append(mpiio.described(hints))
    described.append(local_copies_described())  # every rank keeps node-local copies, or none
    error: MpistratError | None = None
    try:
        for name, value in entries.items():
            if value.holding != POSITION:
                dtype_code(value.dtype, name)
    except InvalidArgumentError as exc:
        error = exc
    collectives.agree(
        "checkpoint.save",
        fingerprint=hash64(repr(described)),
        describe=lambda: {
            "leaves": described,
            "advice": "Every rank must save the same entries (names, dtypes, shapes), with the same "
            "MPI-IO hints (MPISTRAT_IO_HINTS, CheckpointOptions.io_hints), and MPISTRAT_LOCAL_COPIES "
            "set on every rank or on none.",
        },
        error=error,
        options=ALWAYS,
    )
    positions: dict[str, Any] = {}
    datasets: dict[str, Any] = {}  # the split input's positions in words, for people (inspect)
    whole: dict[str, WholeEntry] = {}
    values: dict[str, Any] = {}  # what the whole entries save
    parted: dict[str, PartsEntry] = {}
    for name, value in entries.items():  # collective for positions and sync-on-read variables
        if value.holding == POSITION:
            row, words = value.saved()
            positions[name] = row.tolist()
            if words is not None:
                datasets[name] = words
        elif value.holding == PARTS:
            parted[name] = value
        else:
            whole[name], values[name] = value, value.saved_value()
    order = sorted(whole, key=lambda n: _memory_order(n, whole[n]))
    order += sorted(parted, key=lambda n: parted[n].layout)
    metadata = {
        "num_replicas": str(collectives.size),
        "save_counter": str(counter),
        "positions": json.dumps(positions, sort_keys=True),
    }
    if datasets:
        metadata["datasets"] = json.dumps(datasets, sort_keys=True)
    table, header = lay_out([(n, entries[n].dtype, tuple(entries[n].shape)) for n in order], metadata)
    keep: list[Any] = []
    pieces: list[Piece] = []
    others: list[Piece] = []
    compared = [n for n, value in whole.items() if value.compared]
    if collectives.size == 1 or not check_enabled(collectives):
        compared = []
    try:
        pieces, others = _my_pieces(table, values, parted, compared, collectives.rank, collectives.size, keep)
    except Exception as exc:  # a device-to-host copy: every rank must hear of it
        error = InvalidArgumentError(f"Checkpoint.{method}: {type(exc).__name__}: {exc}")
    mine = mpiio.write_calls(pieces)
    most = collectives.agree("checkpoint.save (plan)", maximum=len(mine), error=error, options=ALWAYS)
    target, tmp = collectives.on_root(lambda: _name_temporary(path), kind=f"checkpoint.{method} (prepare)")
    save = Save(
        method, target, tmp, table, header, metadata, mine, most, compared, others, listing, in_place, keep
    )
    _create(save, collectives, hints)
    return save


DIFFERENT_COPIES = (
    "Checkpoint.{method}: the ranks' copies of a value every rank holds differ, and each rank writes its "
    "share of the file from its own copy, so the file would mix them; it was not kept (the previous "
    "checkpoint stays). Copies differ only through a bug: a write on one rank alone, or arithmetic that "
    "differs between ranks (MPISTRAT_CHECK=strict compares them after every optimizer step)."
)


def copies_of(save: Save) -> list[tuple[str, int]]:
    """``(name, CRC-32C)`` of this rank's copy of each compared value, joined from the checksums of
    its written pieces and of its others."""
    parts: dict[str, list[tuple[int, int, int]]] = {name: [] for name in save.compared}
    for name, start, part, length in [*save.crcs, *save.other_crcs]:
        if name in parts:
            parts[name].append((start, part, length))
    return [(n, CRC32C.joined(parts[n], save.table.entries[n].nbytes) or 0) for n in save.compared]


def _differing_copies(save: Save, copies: list[list[tuple[str, int]]]) -> MpistratError | None:
    """On rank 0: the error naming the values whose copies' CRC-32C differ between ranks, if any."""
    differ = []
    for k, name in enumerate(save.compared):
        by_crc: dict[int, list[int]] = {}
        for rank, mine in enumerate(copies):
            by_crc.setdefault(mine[k][1], []).append(rank)
        if len(by_crc) > 1:
            ranks = "; ".join(f"CRC-32C {c:08x} on ranks {r}" for c, r in by_crc.items())
            differ.append(f"{name!r} ({ranks})")
    if not differ:
        return None
    return CollectiveMismatchError(
        DIFFERENT_COPIES.format(method=save.method) + " Copies that differ: " + ", ".join(differ) + "."
    )


def _memory_order(name: str, value: WholeEntry) -> tuple[int, int, int, str]:
    """Values in an optimizer's flat storage first, in the storage's order (a rank's share is then
    one run of memory, and a restore into the same model gathers straight into it), then by name."""
    place = value.place
    return (0, place[1], place[2], "") if place is not None else (1, 0, 0, name)


def _my_pieces(
    table: Table,
    whole: dict[str, Any],
    parted: dict[str, PartsEntry],
    compared: list[str],
    rank: int,
    size: int,
    keep: list[Any],
) -> tuple[list[Piece], list[Piece]]:
    """This rank's pieces: its even share of the ``whole`` values, every rank's (one run of the file:
    they come first in it), its parts of the ``parted`` entries; and the rest of its copy of the ``compared``
    values, which it checksums but does not write."""
    entries = [e for e in table.entries.values() if e.name in whole]  # in file order
    total = sum(e.nbytes for e in entries)
    lo, hi = share(total, size, rank)
    pieces: list[Piece] = []
    others: list[Piece] = []
    for start, stop, out in ((lo, hi, pieces), (0, lo, others), (hi, total, others)):
        for i, a, b in spans_of_share([e.nbytes for e in entries], start, stop):
            entry = entries[i]
            if out is pieces or entry.name in compared:
                out.append(Piece(entry.name, a, entry.offset + a, _host_bytes(whole[entry.name], a, b, keep)))
    for name, value in parted.items():
        entry = table.entries[name]
        for element, part in value.local_parts():
            start = element * entry.dtype.itemsize
            pieces.append(Piece(name, start, entry.offset + start, _host_bytes(part, 0, None, keep)))
    return pieces, others


def _host_bytes(array: Any, a: int, b: int | None, keep: list[Any]) -> np.ndarray:
    """Bytes ``[a, b)`` of ``array`` in host memory (a view of a NumPy array; a copy from a device)."""
    if packing.array_module(array) is np:
        return bytes_of(array)[a:b]
    xp = packing.array_module(array)
    flat = xp.ascontiguousarray(array).reshape(-1).view(xp.uint8)
    host = flat[a:b].get()
    keep.append(host)
    return host


def _name_temporary(path: str) -> tuple[str, str]:
    """On rank 0: remove what killed saves left beside ``path``; the temporary name to write."""
    files.remove_stale_temporaries(os.path.dirname(path) or ".")
    return path, files.temporary(path)


def _create(save: Save, collectives: Collectives, hints: dict[str, str]) -> None:
    """Every rank creates the temporary file (with the agreed hints) and keeps it open; rank 0
    writes the header. Any rank's failure is raised on every rank, the file removed."""
    mode = MPI.MODE_CREATE | MPI.MODE_WRONLY
    fh, error = mpiio.open_file(collectives.comm, save.tmp, mode, hints)
    if fh is not None and collectives.rank == 0:
        try:
            fh.Write_at(0, np.frombuffer(save.header, np.uint8))
        except MPI.Exception as exc:
            error = mpiio.os_error(exc, "writing the checkpoint's header", save.tmp)
    save.file = fh
    try:
        collectives.agree(f"checkpoint.{save.method} (create)", error=error, options=ALWAYS)
    except BaseException:
        close(save)
        if collectives.rank == 0:
            with contextlib.suppress(OSError):
                os.remove(save.tmp)
        raise


def local_copies_described() -> tuple[str, str, None]:
    """Whether this rank keeps node-local copies (``MPISTRAT_LOCAL_COPIES``), as a save's and a
    restore's handshake compare it: every rank must, or none (``local_copies.py``)."""
    return ("MPISTRAT_LOCAL_COPIES", "set" if config.read("MPISTRAT_LOCAL_COPIES") else "unset", None)


def abandon(save: Save, collectives: Collectives) -> None:
    """A save a rank's death interrupted: its file closed, rank 0's temporary removed (no
    communication: the file is closed over a revoked communicator, whatever MPI says of it)."""
    fh, save.file = save.file, None
    if fh is not None:
        with contextlib.suppress(MPI.Exception):
            fh.Close()
    if collectives.rank == 0:
        with contextlib.suppress(OSError):
            os.remove(save.tmp)


def close(save: Save) -> None:
    fh, save.file = save.file, None
    if fh is not None:
        try:
            fh.Close()
        except MPI.Exception as exc:
            save.error = save.error or mpiio.os_error(exc, "closing the checkpoint file", save.tmp)


def write(save: Save, collectives: Collectives) -> None:
    """Write this rank's pieces now, with collective MPI-IO (every rank calls it), and flush them.

    A thread checksums the pieces (and the rest of this rank's copies): beside the writes where the
    rank has a core to spare, else once they are written, while the flush waits for the disk (a
    thread beside the writes would only take turns with the ranks). :func:`finish` gathers the
    checksums with the errors; rank 0 writes the final header then, and flushes it."""

    def checksums() -> tuple[list[tuple[str, int, int, int]], list[tuple[str, int, int, int]]]:
        return records(p for call in save.calls for p in call), records(save.others)

    beside = crc.spare_core(collectives.hosts, collectives.rank)
    work = crc.in_thread(checksums) if beside else None
    error = mpiio.write_rounds(save.file, save.calls, save.rounds, save.tmp)
    if work is None:
        work = crc.in_thread(checksums)
    try:
        save.file.Sync()
    except MPI.Exception as exc:
        error = error or mpiio.os_error(exc, "flushing the checkpoint file", save.tmp)
    try:
        save.crcs, save.other_crcs = work.result()
    except Exception as exc:  # every rank must hear of it: finish() reports it
        error = error or mpiio.os_error(exc, "checksumming the checkpoint", save.tmp)
    save.error = save.error or error
    close(save)


def _final_header(save: Save, reports: list[tuple[list[tuple[str, int, int, int]], Any]]) -> bytes:
    """The header with each entry's CRC-32C, joined from every rank's ``(records, copies)``: the
    ``(entry, start, crc, length)`` of its pieces and its copies' checksums, which must agree."""
    refusal = _differing_copies(save, [copies for _, copies in reports])
    if refusal is not None:
        raise refusal
    parts: dict[str, list[tuple[int, int, int]]] = {name: [] for name in save.table.entries}
    for mine, _ in reports:
        for name, start, part, length in mine:
            parts[name].append((start, part, length))
    crcs = {}
    for name, entry in save.table.entries.items():
        joined = CRC32C.joined(parts[name], entry.nbytes)
        if joined is None:  # a bug, not damage: the ranks' pieces must tile every entry
            raise MpistratError(f"Checkpoint.{save.method}: the ranks' pieces of {name} do not tile it")
        crcs[name] = joined
    return encode_header(header_rows(save.table), save.metadata, crcs)


def finish(save: Save, collectives: Collectives) -> float | None:
    """Every rank's errors and checksums to rank 0, which completes the file and renames it into
    place (or removes it); raises the first error on every rank (collective).
    Returns how long the slowest background writer took (None for a save written at once)."""
    if save.thread is not None:
        save.thread.join()
    error = None if save.error is None else (save.error.errno, str(save.error))
    reports = collectives.gather_to_root(
        (error, (save.crcs, copies_of(save)), save.seconds), kind=f"checkpoint.{save.method} (errors)"
    )
    return collectives.on_root(
        lambda: _complete(save, reports or []), kind=f"checkpoint.{save.method} (rename)"
    )


def _complete(save: Save, reports: list[Any]) -> float | None:
    """On rank 0: the header with the checksums, fsync, rename, the index; or the first error.
    Returns the slowest writer's seconds."""
    try:
        failed = [(r, e) for r, (e, _, _) in enumerate(reports) if e is not None]
        if failed:
            rank, (code, text) = failed[0]
            others = f" (and on ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
            raise OSError(code or None, f"Checkpoint.{save.method} failed on rank {rank}{others}: {text}")
        header = save.header = _final_header(save, [checked for _, checked, _ in reports])
        fd = os.open(save.tmp, os.O_WRONLY)
        try:
            os.pwrite(fd, header, 0)
        finally:
            os.close(fd)
        files.replace_durably(save.tmp, save.path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(save.tmp)
        raise
    if save.listing is not None:
        files.record(save.listing)
    return max((seconds for _, _, seconds in reports if seconds is not None), default=None)
