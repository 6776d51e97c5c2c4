"""Format 1, the ``.npz`` checkpoints of earlier versions: read into the same table as format 2.

A format-1 file is a zip, stored uncompressed: one ``.npy`` member per entry, then
``save_counter`` and ``__mpistrat__`` (``{"format": 1, ...}``). Each member's data sits at a
known offset (after its local zip header and its ``.npy`` header), so the ranks read these
files in parallel exactly as format 2. The zip's CRC-32 covers the ``.npy`` header and the
data: the table carries the header's CRC (``Entry.prefix``) so the data's parts still check
against it. A member whose data is shorter or longer than its ``.npy`` header says is
corrupt, whatever its CRC. Dataset positions are ordinary entries here.
"""

from __future__ import annotations

import json
import math
import struct
import zipfile
import zlib
from typing import IO, Any

import numpy as np

from mpistrat.checkpoint.crc import CRC32
from mpistrat.checkpoint.format import Entry, Table, corrupt, integer

__all__ = ["read_table"]

_META, _COUNTER = "__mpistrat__", "save_counter"
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # a zip member's local header, before its name and extra field
# What a truncated or corrupt zip raises while being read, depending on where the damage is.
_DAMAGE = (
    zipfile.BadZipFile,
    zlib.error,
    ValueError,
    EOFError,
    KeyError,
    OSError,
    NotImplementedError,
    struct.error,
    RecursionError,  # JSON nested too deep
)


def read_table(path: str, f: IO[bytes]) -> Table | None:
    """The entries of the format-1 file ``path`` open as ``f``; None if it is not an mpistrat checkpoint."""
    try:
        with zipfile.ZipFile(f) as archive:
            infos = {i.filename.removesuffix(".npy"): i for i in archive.infolist()}
            if _META not in infos:
                return None
            meta = json.loads(str(_small(archive, infos.pop(_META))))
            if not isinstance(meta, dict) or meta.get("format") != 1:
                raise ValueError(f"unknown format {meta!r}")
            counter = infos.pop(_COUNTER, None)
            entries = {name: _entry(f, info) for name, info in infos.items()}
            saved = None if counter is None else _small(archive, counter)
    except _DAMAGE as exc:
        raise corrupt(path, f"{type(exc).__name__}: {exc}") from None
    replicas = meta.get("num_replicas")
    return Table(
        path,
        entries,
        0,
        None if saved is None else integer(path, "save_counter", saved),
        None if replicas is None else integer(path, "num_replicas", replicas, 1),
        {},
        1,
        escaped=False,
        checksum=CRC32,
    )


def _small(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> Any:
    """A small member read whole (its CRC checked by zipfile)."""
    with archive.open(info) as member:
        return np.lib.format.read_array(member, allow_pickle=False)


def _entry(f: IO[bytes], info: zipfile.ZipInfo) -> Entry:
    """Where member ``info``'s data lies and what its checksum must be."""
    name = info.filename.removesuffix(".npy")
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"member {info.filename} is compressed")
    f.seek(info.header_offset)
    local = _LOCAL.unpack(f.read(_LOCAL.size))
    if local[0] != 0x04034B50:
        raise ValueError(f"member {info.filename} has no local header")
    start = info.header_offset + _LOCAL.size + local[-2] + local[-1]  # after its name and extra field
    f.seek(start)
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise ValueError(f"member {info.filename}: unsupported .npy version {version}")
    if dtype.hasobject:
        raise ValueError(f"member {info.filename} holds Python objects")
    head = f.tell() - start
    nbytes = math.prod(shape) * dtype.itemsize
    if info.file_size != head + nbytes:
        raise ValueError(
            f"member {info.filename} holds {info.file_size - head} bytes of data; its header says "
            f"{dtype}{list(shape)}, {nbytes} bytes"
        )
    f.seek(start)
    prefix = (zlib.crc32(f.read(head)), head)
    f.seek(0, 2)
    if start + info.file_size > f.tell():
        raise ValueError(f"member {info.filename} runs past the end of the file")
    return Entry(name, dtype, tuple(shape), start + head, nbytes, info.CRC, prefix, bool(fortran))
