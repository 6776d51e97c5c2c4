"""The checkpoint file: the safetensors layout, so any safetensors reader opens it without mpistrat.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON, then the data:

- the JSON maps each entry's name to ``{"dtype": "F32", "shape": [...], "data_offsets": [b, e]}``
  (bytes ``b`` to ``e`` after the header, C order), and ``__metadata__`` (strings only) to
  ``header_crc32``, ``format`` (``mpistrat/2``), ``num_replicas``, ``save_counter``,
  ``positions`` (a JSON object: each dataset's position), ``datasets`` (where there is split
  input: its positions in words, the epoch, the batches and examples taken and the seed, for
  people), ``crc32c`` (a JSON object: each entry's CRC-32C as 8 hex digits, what
  ``crc32c.crc32c`` gives over its bytes; files of earlier versions have ``crc32`` instead, each
  entry's CRC-32 as ``zlib.crc32`` gives it) and, where an entry is complex128, ``dtypes`` (a
  JSON object naming those entries: safetensors has no complex128, so they are stored as ``F64``
  with a last dimension of 2, the real and imaginary parts, NumPy's own layout);
- the header covers itself: it begins ``{"__metadata__":{"header_crc32":"``, and the 8 hex
  digits that follow are the CRC-32 of the file's first ``8 + N`` bytes (the length and the
  JSON) with those 8 digits left out, so a byte changed anywhere in the header or its metadata
  is found (files of earlier versions have no ``header_crc32``: their header is checked for
  consistency only);
- the entries tile the data without gaps, in the order :func:`lay_out` is given (the replicated
  values first, then each sharded slot group: every rank's share is then one run of bytes);
- the JSON is padded with spaces so the data starts at a multiple of 8.

Every offset is known before any data moves, so every rank writes its share at once, and
the header is the same length whatever the checksums are: rank 0 writes it first and fills
the checksums in at the end. :func:`read_table` checks a header before anything is read.

>>> import numpy as np
>>> table, head = lay_out([("w", np.dtype("float32"), (2, 3))], {"save_counter": "1"})
>>> table.entries["w"].offset, table.entries["w"].nbytes, len(head) % 8
(184, 24, 0)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import zlib
from collections.abc import Callable
from typing import IO, Any

import numpy as np

from mpistrat.checkpoint.crc import CRC32, CRC32C, Checksum
from mpistrat.errors import InvalidArgumentError

__all__ = [
    "FORMAT",
    "Entry",
    "Table",
    "corrupt",
    "dtype_code",
    "encode_header",
    "header_crc",
    "header_rows",
    "integer",
    "lay_out",
    "read_table",
    "renamed",
]

FORMAT = "mpistrat/2"
# The header begins so: the 8 hex digits of its own CRC-32 follow, at a fixed offset.
_SEALED = b'{"__metadata__":{"header_crc32":"'
_LEGACY_KEYS = {"format", "num_replicas", "save_counter", "positions", "crc32"}  # a header without its CRC
_LENGTH = struct.Struct("<Q")
_MAX_HEADER = 100 << 20  # as safetensors: a header this large is damage, not a checkpoint
_CODES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "float16": "F16",
    "bfloat16": "BF16",  # ml_dtypes' NumPy dtypes, where installed
    "uint32": "U32",
    "int32": "I32",
    "float32": "F32",
    "uint64": "U64",
    "int64": "I64",
    "float64": "F64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_NAMES = {code: name for name, code in _CODES.items()}
# dtypes safetensors has no code for, stored as pairs of a dtype it has (the last dimension, of 2,
# is the real and imaginary parts: NumPy's own layout), with the dtype in the metadata's ``dtypes``.
_PAIRS = {"complex128": np.dtype("float64")}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One array in a checkpoint file: where its bytes are and what they must checksum to."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int
    crc: int | None = None  # the checksum of its bytes (with ``prefix``'s bytes before them, if any)
    prefix: tuple[int, int] = (0, 0)  # (checksum, length) of bytes the checksum covers before the data
    fortran: bool = False  # format 1 only: the bytes are in Fortran order


@dataclasses.dataclass
class Table:
    """What a checkpoint file holds: its entries and what its metadata says."""

    path: str
    entries: dict[str, Entry]  # in file order
    data_start: int = 0  # where the data begins (the entries' offsets count from the file's start)
    counter: int | None = None  # the save counter
    num_replicas: int | None = None  # the ranks that saved it
    positions: dict[str, Any] = dataclasses.field(default_factory=dict)  # datasets' positions
    format: int = 2
    sealed: bool = True  # the header and metadata are covered by a checksum (not in early format-2 files)
    checksum: Checksum = CRC32C  # what the entries' checksums are (CRC-32 in files of earlier versions)
    escaped: bool = True  # names escape "." and "/" in keys (files with a sealed header do; earlier ones not)
    # split input's positions in words: epoch, batches and examples taken, seed (not in older files)
    datasets: dict[str, Any] = dataclasses.field(default_factory=dict)


def dtype_code(dtype: np.dtype, name: str) -> str:
    """safetensors' name of the dtype ``dtype`` is stored as, or an error naming the entry that has it."""
    dtype = np.dtype(dtype)
    code = _CODES.get(_PAIRS.get(dtype.name, dtype).name)
    if code is None or dtype.byteorder == ">":
        raise InvalidArgumentError(
            f"Checkpoint: {name} is {dtype}, which the checkpoint format (safetensors) cannot hold; "
            f"expected one of {', '.join(sorted([*_CODES, *_PAIRS]))} (little-endian)"
        )
    return code


def lay_out(
    specs: list[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict[str, str]
) -> tuple[Table, bytes]:
    """Offsets for ``specs`` (name, dtype, shape) laid end to end in this order, and the header
    (with every checksum 0: :func:`encode_header` gives the same length with the real ones)."""
    names = [name for name, _, _ in specs]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"Checkpoint: entry names repeat: {names}")
    sizes = [math.prod(shape) * np.dtype(dtype).itemsize for _, dtype, shape in specs]
    ends = np.cumsum([0, *sizes]).tolist()
    head = encode_header(
        [
            (n, np.dtype(d), tuple(s), b, e)
            for (n, d, s), b, e in zip(specs, ends[:-1], ends[1:], strict=True)
        ],
        metadata,
        {},
    )
    entries = {
        n: Entry(n, np.dtype(d), tuple(s), len(head) + b, e - b)
        for (n, d, s), b, e in zip(specs, ends[:-1], ends[1:], strict=True)
    }
    return Table("", entries, len(head)), head


def encode_header(
    rows: list[tuple[str, np.dtype, tuple[int, ...], int, int]],
    metadata: dict[str, str],
    crcs: dict[str, int],
) -> bytes:
    """The length and JSON header of entries ``(name, dtype, shape, begin, end)`` (data offsets)."""
    meta = {
        "header_crc32": "00000000",  # filled in below, once the rest is known
        "format": FORMAT,
        **metadata,
        CRC32C.key: json.dumps({n: f"{crcs.get(n, 0):08x}" for n, *_ in rows}),
    }
    if pairs := {name: dtype.name for name, dtype, *_ in rows if dtype.name in _PAIRS}:
        meta["dtypes"] = json.dumps(pairs)
    header: dict[str, Any] = {"__metadata__": meta}
    for name, dtype, shape, begin, end in rows:
        stored = [*shape, 2] if dtype.name in _PAIRS else list(shape)
        header[name] = {"dtype": dtype_code(dtype, name), "shape": stored, "data_offsets": [begin, end]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + _LENGTH.size) % 8)
    head = _LENGTH.pack(len(text)) + text
    at = _LENGTH.size + len(_SEALED)
    return head[:at] + f"{header_crc(head):08x}".encode() + head[at + 8 :]


def header_crc(head: bytes) -> int:
    """The CRC-32 of a header (its length and JSON) less the 8 digits that hold it."""
    at = _LENGTH.size + len(_SEALED)
    return zlib.crc32(head[at + 8 :], zlib.crc32(head[:at]))


def header_rows(table: Table) -> list[tuple[str, np.dtype, tuple[int, ...], int, int]]:
    """``table``'s entries as :func:`encode_header` takes them."""
    at = table.data_start
    return [
        (e.name, e.dtype, e.shape, e.offset - at, e.offset - at + e.nbytes) for e in table.entries.values()
    ]


def renamed(table: Table, rename: Callable[[str], str]) -> Table:
    """``table`` with every entry and position named ``rename(name)``."""
    entries = {rename(n): dataclasses.replace(e, name=rename(n)) for n, e in table.entries.items()}
    positions = {rename(n): p for n, p in table.positions.items()}
    datasets = {rename(n): d for n, d in table.datasets.items()}
    return dataclasses.replace(table, entries=entries, positions=positions, datasets=datasets, escaped=True)


def corrupt(path: str, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"Checkpoint.restore: {path} is truncated or corrupt and cannot be read ({why})"
    )


def read_table(path: str, f: IO[bytes], size: int | None = None) -> Table | None:
    """The entries and metadata of the format-2 file ``path`` open as ``f``, checked; None for a
    safetensors file that is not an mpistrat checkpoint. ``size``: the file's bytes, where ``f``
    holds only its header (a node-local copy's; else ``f``'s own size).

    Checks, before anything is restored: the header's length and JSON, every entry's dtype, shape
    and byte range (inside the file, no overlaps, no gaps, as safetensors requires), the data's
    length against the file's, a checksum for every entry, and the metadata's numbers (the save
    counter, the rank count, the datasets' positions: int64 integers).
    """
    f.seek(0)
    start = f.read(_LENGTH.size)
    size = os.fstat(f.fileno()).st_size if size is None else size
    if len(start) < _LENGTH.size:
        raise corrupt(path, f"{size} bytes: shorter than the header's length")
    (length,) = _LENGTH.unpack(start)
    if length > min(_MAX_HEADER, size - _LENGTH.size):
        raise corrupt(path, f"a header of {length} bytes in a file of {size}")
    text = f.read(length)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise corrupt(path, f"the header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise corrupt(path, "the header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None
    sealed = _check_seal(path, start + text, meta)
    data_start = _LENGTH.size + length
    entries = {name: _entry(path, name, spec, data_start) for name, spec in header.items()}
    _check_tiling(path, list(entries.values()), data_start, size)
    checksum = CRC32C if CRC32C.key in meta else CRC32
    try:
        crcs = json.loads(meta[checksum.key])
        for name, dtype in json.loads(meta.get("dtypes", "{}")).items():
            entries[name] = _as_pairs(path, entries[name], dtype)
        table = Table(
            path,
            {
                n: dataclasses.replace(e, crc=int(crcs[n], 16))
                for n, e in sorted(entries.items(), key=_by_offset)
            },
            data_start,
            positions=json.loads(meta.get("positions", "{}")),
            datasets=json.loads(meta.get("datasets", "{}")),
            sealed=sealed,
            escaped=sealed,  # both came in one version
            checksum=checksum,
        )
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise corrupt(path, f"the metadata is incomplete ({type(exc).__name__}: {exc})") from None
    if "save_counter" in meta:
        table.counter = integer(path, "save_counter", meta["save_counter"])
    if "num_replicas" in meta:
        table.num_replicas = integer(path, "num_replicas", meta["num_replicas"], 1)
    if not isinstance(table.positions, dict):
        raise corrupt(path, "the positions are not a JSON object")
    if not isinstance(table.datasets, dict):
        raise corrupt(path, "the datasets' positions in words are not a JSON object")
    for name, position in table.positions.items():
        _int64s(path, f"the position of {name}", position)
    return table


def _check_seal(path: str, head: bytes, meta: dict[str, Any]) -> bool:
    """Whether the header has its own CRC-32, which matches it; a header without one (an earlier
    version's) may hold only the metadata those versions wrote (a changed key is not taken for an
    older file)."""
    if "header_crc32" not in meta:
        if unknown := sorted(set(meta) - _LEGACY_KEYS):
            raise corrupt(path, f"unknown metadata {unknown} and no header_crc32")
        return False
    at = _LENGTH.size + len(_SEALED)
    written = meta["header_crc32"]
    if not head.startswith(_SEALED, _LENGTH.size) or head[at : at + 8] != str(written).encode():
        raise corrupt(path, "the header's checksum is not where the format puts it")
    if written != f"{header_crc(head):08x}":
        raise corrupt(path, "the header's checksum differs: a byte of the header or its metadata changed")
    return True


def integer(path: str, what: str, value: Any, least: int = 0) -> int:
    """A number of the metadata (``value``, its text) as an int64 of at least ``least``; else the
    file is corrupt."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        raise corrupt(path, f"{what} is {str(value)[:40]!r}, not an integer") from None
    if not least <= number < 2**63:
        raise corrupt(path, f"{what} is {str(value)[:40]}, outside [{least}, 2**63)")
    return number


def _int64s(path: str, what: str, value: Any) -> None:
    """``value`` (a saved position) is int64s, a number or a rectangular nest of lists of them."""
    try:
        ok = np.asarray(value, np.int64).tolist() == value  # beyond int64: OverflowError
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise corrupt(path, f"{what} is {str(value)[:60]}, not int64 integers")


def _as_pairs(path: str, entry: Entry, dtype: str) -> Entry:
    """``entry``, stored as pairs of ``_PAIRS[dtype]`` (its last dimension, of 2), as ``dtype``."""
    if _PAIRS.get(dtype) != entry.dtype or entry.shape[-1:] != (2,):
        raise corrupt(
            path, f"entry {entry.name!r} is {entry.dtype}{list(entry.shape)}, not {dtype} stored as pairs"
        )
    return dataclasses.replace(entry, dtype=np.dtype(dtype), shape=entry.shape[:-1])


def _by_offset(item: tuple[str, Entry]) -> int:
    return item[1].offset


def _entry(path: str, name: str, spec: Any, data_start: int) -> Entry:
    try:
        dtype = np.dtype(_NAMES[spec["dtype"]])
        shape = tuple(spec["shape"])
        begin, end = spec["data_offsets"]
        numbers = [*shape, begin, end]
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in numbers):
            raise ValueError(f"shape {shape} and offsets [{begin}, {end}] must be integers >= 0")
    except (KeyError, TypeError, ValueError) as exc:
        raise corrupt(path, f"entry {name!r}: {type(exc).__name__}: {exc}") from None
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise corrupt(
            path, f"entry {name!r} is {dtype}{list(shape)}, {nbytes} bytes, but spans [{begin}, {end})"
        )
    return Entry(name, dtype, shape, data_start + begin, nbytes)


def _check_tiling(path: str, entries: list[Entry], data_start: int, size: int) -> None:
    """The entries cover the data exactly (as safetensors requires), and the file holds it all."""
    at = data_start
    for e in sorted(entries, key=lambda e: (e.offset, e.nbytes)):
        if e.offset != at:
            what = (
                "overlaps the entry before it" if e.offset < at else f"leaves a gap of {e.offset - at} bytes"
            )
            raise corrupt(path, f"entry {e.name!r} at [{e.offset - data_start}, ...) {what}")
        at += e.nbytes
    if at != size:
        short = at > size
        raise corrupt(
            path,
            f"the entries need {at} bytes; the file has {size}"
            + (" (truncated)" if short else " (extra bytes)"),
        )
