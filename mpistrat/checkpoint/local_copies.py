"""Node-local copies of each rank's share of the newest checkpoint, and restores that read them
instead of the shared file (``MPISTRAT_LOCAL_COPIES=DIR``, a directory on each node's own storage
such as ``/dev/shm/<job>`` or ``$TMPDIR``; off by default).

Once a save is in place (:func:`keep`, collective), each rank writes the bytes of its share of the
file (rank 0's with the file's header) to ``DIR``, and sends them to its keeper, rank
``(r + n) mod R`` with ``n`` the most ranks one node holds (on another node where nodes hold
consecutive ranks, as the keepers of a sharded optimizer's slots), which writes them there too.
Per save and rank: one share written and sent, one received and written (the exchange is padded
to the longest share, rank 0's with the header); nothing grows with R. A rank keeps only the
newest checkpoint's copies, removing older ones as it writes new ones; the directory itself is the
job's to remove (``jobs/train.sbatch`` does).

A restore (:func:`find`, collective) looks there first: the ranks on each node share out the
copies they find there, and when every share of the checkpoint is held by some rank (its own
copy, or its keeper's), the table of contents comes from the holder of rank 0's share and each
rank's reads are served by the holders (:meth:`Copies.read`: one all-to-all of how many byte
ranges each rank asks of each, one of the ranges, one of the bytes): the shared file is not
opened. Otherwise (a share lost with its keeper's copy, copies of another save, none yet) the
file is read, as without copies. The checksums are checked either way.

>>> merged([(0, 4), (4, 2), (10, 1)])
[(0, 6), (10, 1)]
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hashlib
import io
import itertools
import json
import os
import struct
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from mpistrat import config
from mpistrat.checkpoint import format
from mpistrat.checkpoint.pieces import Piece
from mpistrat.checkpoint.saving import ALWAYS, Save
from mpistrat.log import logger
from mpistrat.training.shard_copies import keeper_shift

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["Copies", "Held", "directory", "find", "keep", "merged"]

_LENGTH = struct.Struct("<Q")  # a copy: its metadata's length, the metadata (JSON), the share's bytes
KIND = "checkpoint (node-local copies)"


@dataclasses.dataclass(frozen=True)
class Held:
    """What one copy holds: rank ``rank``'s share of a save over ``size`` ranks (``save`` names that
    save: its temporary file), ``ranges`` of the checkpoint file of ``file_size`` bytes, in order."""

    rank: int
    size: int
    save: str
    file_size: int
    ranges: tuple[tuple[int, int], ...]  # (offset in the file, bytes)


def directory() -> str | None:
    """Where node-local copies go (``MPISTRAT_LOCAL_COPIES``); None: nowhere."""
    found: str | None = config.read("MPISTRAT_LOCAL_COPIES")
    return found


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges in order, adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for offset, length in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + length)
        elif length:
            out.append((offset, length))
    return out


def keep(save: Save, collectives: Collectives) -> None:
    """Write this rank's share of the save just put in place to the node-local directory, and its
    partner's, which it receives (collective; nothing where ``MPISTRAT_LOCAL_COPIES`` is unset,
    which every rank agreed on when the save began)."""
    where = directory()
    if where is None:
        return
    rank, size = collectives.rank, collectives.size
    pieces = [p for call in save.calls for p in call]
    if rank == 0:  # rank 0's share holds the header, the final one (with every checksum)
        header = np.frombuffer(save.header, np.uint8)
        pieces.insert(0, Piece("", 0, 0, header))
    file_size = max((e.offset + e.nbytes for e in save.table.entries.values()), default=len(save.header))
    held = Held(rank, size, os.path.basename(save.tmp), file_size, ())
    mine = _encode(held, pieces)
    longest = int(collectives.agree(KIND, maximum=mine.size, options=ALWAYS))
    send, kept = np.zeros(longest, np.uint8), np.zeros(longest, np.uint8)
    send[: mine.size] = mine
    if size > 1:
        shift = keeper_shift(collectives.hosts, size)
        collectives.exchange(send, (rank + shift) % size, kept, (rank - shift) % size, kind=KIND)
    prefix = _prefix(save.path)
    try:
        os.makedirs(where, exist_ok=True)
        partner = _decode_held(kept) if size > 1 else None
        names = {f"{prefix}.{rank}": mine}
        if partner is not None:
            names[f"{prefix}.{partner.rank}.kept"] = kept
        _remove_older(where, rank, None if partner is None else partner.rank, prefix)
        for name, blob in names.items():
            _write(os.path.join(where, name), blob)
    except (OSError, ValueError) as exc:  # the save is in place: a restore then reads the shared file
        logger.warning("Checkpoint: no node-local copy of %s in %s (%s)", save.path, where, exc)


def find(path: str, collectives: Collectives) -> Copies | None:
    """The node-local copies of checkpoint ``path``, when every share of one save is held by some
    rank (collective; the same answer on every rank); None: read the file."""
    where = directory()
    if where is None:
        return None
    claimed = _claimed(where, path, collectives)
    gathered = collectives.gather_to_root([held for held, _ in claimed], kind=KIND)
    holders = collectives.on_root(lambda: _holders(gathered or []), kind=KIND)
    if holders is None:
        return None
    mine = {held.rank: name for held, name in claimed if holders[held.rank][0] == collectives.rank}
    return Copies(path, holders, mine)


class Copies:
    """The copies a restore reads: ``holders[r]`` is the rank serving rank ``r``'s share of the save
    (and what it holds); ``mine``, the local files of the shares this rank serves, by share."""

    def __init__(self, path: str, holders: list[tuple[int, Held]], mine: dict[int, str]):
        self.path, self.holders, self.mine = path, holders, mine
        self.intervals = sorted(
            (offset, offset + length, holder, share, at)
            for share, (holder, held) in enumerate(holders)
            for offset, length, at in _positions(held.ranges)
        )
        self.starts = [iv[0] for iv in self.intervals]

    def table(self, collectives: Collectives, method: str) -> format.Table | None:
        """The checkpoint's table of contents, read from rank 0's share by its holder (collective)."""
        holder, held = self.holders[0]

        def read() -> format.Table | None:
            with self._open(0) as (f, start):  # rank 0's share begins with the file's header
                (length,) = _LENGTH.unpack(os.pread(f.fileno(), _LENGTH.size, start))
                head = os.pread(f.fileno(), _LENGTH.size + length, start)
            return format.read_table(self.path, io.BytesIO(head), held.file_size)

        table = collectives.on_root(read, holder, kind=f"checkpoint.{method} (read a node-local copy)")
        if collectives.rank == 0:
            said = "Checkpoint.%s: %s read from node-local copies (MPISTRAT_LOCAL_COPIES)"
            logger.info(said, method, self.path)
        return table

    def read(self, calls: list[list[Piece]], collectives: Collectives) -> OSError | None:
        """Fill the pieces of ``calls`` from the holders (collective: every rank asks, every holder
        serves); the error a holder met reading its copies (it sends zeros for them)."""
        size = collectives.size
        asked: list[list[tuple[int, int, int]]] = [[] for _ in range(size)]  # per holder: (share, offset, n)
        into: list[list[np.ndarray]] = [[] for _ in range(size)]
        for piece in (p for call in calls for p in call):
            a, b = piece.offset, piece.offset + piece.nbytes
            i = bisect.bisect_right(self.starts, a) - 1
            while a < b:
                _, hi, holder, share, _ = self.intervals[i]
                take = min(b, hi) - a
                asked[holder].append((share, a, take))
                into[holder].append(piece.memory[a - piece.offset : a - piece.offset + take])
                a, i = a + take, i + 1
        counts = np.array([len(q) for q in asked], np.int64)
        theirs = np.empty(size, np.int64)
        _all_to_all(collectives, counts, [8] * size, theirs, [8] * size)
        requests = np.array([r for q in asked for r in q], np.int64).reshape(-1, 3)
        wanted = np.empty((int(theirs.sum()), 3), np.int64)
        _all_to_all(
            collectives, requests, [24 * int(n) for n in counts], wanted, [24 * int(n) for n in theirs]
        )
        served, error = self._serve(wanted)
        recv_counts = [sum(n for _, _, n in q) for q in asked]
        received = np.empty(sum(recv_counts), np.uint8)
        _all_to_all(collectives, served, _sums(wanted[:, 2], theirs), received, recv_counts)
        at = 0
        for dests in into:
            for dest in dests:
                dest[...] = received[at : at + dest.size]
                at += dest.size
        return error

    def _serve(self, wanted: np.ndarray) -> tuple[np.ndarray, OSError | None]:
        """The bytes asked of this rank (``(share, offset, n)`` rows), in the order asked."""
        out = np.zeros(int(wanted[:, 2].sum()), np.uint8)
        error, at = None, 0
        with contextlib.ExitStack() as stack:
            opened: dict[int, tuple[IO[bytes], int]] = {}
            for share, offset, n in wanted.tolist():
                try:  # a copy removed or damaged since it was found: an error every rank hears of
                    if share not in opened:
                        opened[share] = stack.enter_context(self._open(share))
                    f, start = opened[share]
                    data = os.pread(f.fileno(), n, start + self._within(share, offset, n))
                    if len(data) != n:
                        raise OSError(f"{f.name} is shorter than its metadata says")
                    out[at : at + n] = np.frombuffer(data, np.uint8)
                except (OSError, ValueError, KeyError, struct.error) as exc:
                    error = error or OSError(f"the node-local copy of rank {share}'s share: {exc}")
                at += n
        return out, error

    def _within(self, share: int, offset: int, n: int) -> int:
        """Where bytes ``[offset, offset + n)`` of the file lie in the data of the copy of ``share``."""
        for lo, length, at in _positions(self.holders[share][1].ranges):
            if lo <= offset and offset + n <= lo + length:
                return at + offset - lo
        raise ValueError(f"bytes {offset} to {offset + n} of the file are not in it")

    @contextlib.contextmanager
    def _open(self, share: int) -> Iterator[tuple[IO[bytes], int]]:
        """The copy of ``share`` this rank serves, open, and where its data starts."""
        with open(self.mine[share], "rb") as f:
            (length,) = _LENGTH.unpack(f.read(_LENGTH.size))
            yield f, _LENGTH.size + length


def _encode(held: Held, pieces: list[Piece]) -> np.ndarray:
    """A copy's bytes: its metadata's length, the metadata, the pieces' bytes in file order."""
    pieces = sorted((p for p in pieces if p.nbytes), key=lambda p: p.offset)
    ranges = merged([(p.offset, p.nbytes) for p in pieces])
    meta = json.dumps(dataclasses.asdict(dataclasses.replace(held, ranges=tuple(ranges)))).encode()
    out = np.empty(_LENGTH.size + len(meta) + sum(p.nbytes for p in pieces), np.uint8)
    out[: _LENGTH.size] = np.frombuffer(_LENGTH.pack(len(meta)), np.uint8)
    out[_LENGTH.size : _LENGTH.size + len(meta)] = np.frombuffer(meta, np.uint8)
    at = _LENGTH.size + len(meta)
    for p in pieces:
        out[at : at + p.nbytes] = p.memory
        at += p.nbytes
    return out[:at]


def _decode_held(blob: Any) -> Held:
    """The metadata at the start of a copy's bytes (``ValueError`` if there is none)."""
    data = bytes(blob[: _LENGTH.size])
    (length,) = _LENGTH.unpack(data)
    meta = json.loads(bytes(blob[_LENGTH.size : _LENGTH.size + length]))
    return Held(
        int(meta["rank"]), int(meta["size"]), str(meta["save"]), int(meta["file_size"]),
        tuple((int(o), int(n)) for o, n in meta["ranges"]),
    )  # fmt: skip


def _positions(ranges: tuple[tuple[int, int], ...]) -> list[tuple[int, int, int]]:
    """``(offset, length, where in the copy's data)`` of each range."""
    out, at = [], 0
    for offset, length in ranges:
        out.append((offset, length, at))
        at += length
    return out


def _prefix(path: str) -> str:
    """The names of ``path``'s copies begin with its name and a digest of where it is."""
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    return f"{os.path.basename(path)}.{digest}"


def _claimed(where: str, path: str, collectives: Collectives) -> list[tuple[Held, str]]:
    """The copies of ``path`` this rank serves: those in its node's directory, shared out over the
    ranks on its node (by host name) in name order."""
    prefix = _prefix(path) + "."
    with contextlib.suppress(OSError):
        names = sorted(n for n in os.listdir(where) if n.startswith(prefix) and not n.endswith(".tmp"))
        hosts, rank = collectives.hosts, collectives.rank
        mates = [r for r in range(collectives.size) if not hosts or hosts[r] == hosts[rank]]
        out = []
        for name in names[mates.index(rank) :: len(mates)]:
            try:
                with open(os.path.join(where, name), "rb") as f:
                    (length,) = _LENGTH.unpack(f.read(_LENGTH.size))
                    out.append(
                        (_decode_held(_LENGTH.pack(length) + f.read(length)), os.path.join(where, name))
                    )
            except (OSError, ValueError, KeyError, struct.error):
                continue  # a copy being written, or damaged: as if it were not there
        return out
    return []


def _holders(gathered: list[list[Held]]) -> list[tuple[int, Held]] | None:
    """On one rank: for each share of one save, the lowest rank holding a copy of it; None unless
    every share is held (copies of one save only)."""
    found: dict[tuple[str, int, int], dict[int, tuple[int, Held]]] = {}
    for rank, helds in enumerate(gathered):
        for held in helds:
            found.setdefault((held.save, held.size, held.file_size), {}).setdefault(held.rank, (rank, held))
    complete = [
        shares
        for (_, size, file_size), shares in found.items()
        if sorted(shares) == list(range(size))
        and merged([r for _, held in shares.values() for r in held.ranges]) == [(0, file_size)]
    ]  # every byte of the file in exactly one share
    if len(complete) != 1:
        return None
    return [complete[0][r] for r in range(len(complete[0]))]


def _remove_older(where: str, rank: int, partner: int | None, prefix: str) -> None:
    """This rank's copies of earlier checkpoints (its own share's, and its partner's it kept)."""
    ours = (f".{rank}",) if partner is None else (f".{rank}", f".{partner}.kept")
    for name in os.listdir(where):
        if name.endswith(ours) and not name.startswith(prefix + "."):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(where, name))


def _write(path: str, blob: np.ndarray) -> None:
    """``blob`` to ``path``, whole or not at all (through a temporary name)."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(blob.data)
    os.replace(tmp, path)


def _sums(lengths: np.ndarray, counts: np.ndarray) -> list[int]:
    """``lengths`` summed in runs of ``counts``."""
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return [int(lengths[a:b].sum()) for a, b in itertools.pairwise(bounds)]


def _all_to_all(
    collectives: Collectives,
    send: np.ndarray,
    send_counts: list[int],
    recv: np.ndarray,
    recv_counts: list[int],
) -> None:
    """Bytes of ``send`` to every rank, ``send_counts[r]`` of them to rank ``r``; into ``recv``, likewise."""
    send, recv = send.reshape(-1).view(np.uint8), recv.reshape(-1).view(np.uint8)
    collectives.all_to_all_bytes(send, send_counts, recv, recv_counts, kind=KIND)
