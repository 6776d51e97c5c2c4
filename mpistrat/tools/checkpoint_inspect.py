"""``mpistrat checkpoint inspect PATH``: what a checkpoint file holds, and whether its bytes are intact.

Prints the format, the rank count and save counter it was written with, dataset positions, and
one row per entry (dtype, shape, bytes, CRC-32), then checks every entry's checksum, reading the
file once in pieces (``--no-verify`` skips that); the header's own checksum is checked first.
``--json`` prints the same as one JSON object.
One process does it all: run it without ``mpiexec``. Exit status: 0 intact, 1 a checksum does not
match, 2 the file cannot be read as a checkpoint.

    $ mpistrat checkpoint inspect ckpts/ckpt-3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib
from typing import Any

from mpistrat.checkpoint import crc
from mpistrat.checkpoint.files import read_table
from mpistrat.checkpoint.format import Entry, Table
from mpistrat.errors import InvalidArgumentError

__all__ = ["main", "verify"]

_CHUNK = 16 << 20


def verify(table: Table) -> list[str]:
    """The names of the entries whose bytes do not match their checksums (the file read once)."""
    bad = []
    with open(table.path, "rb") as f:
        for entry in table.entries.values():
            if _checksum(f, entry) != entry.crc:
                bad.append(entry.name)
    return bad


def _checksum(f: Any, entry: Entry) -> int:
    f.seek(entry.offset)
    value, left = 0, entry.nbytes
    while left:
        chunk = f.read(min(left, _CHUNK))
        if not chunk:
            return -1  # shorter than its header says
        value, left = zlib.crc32(chunk, value), left - len(chunk)
    prefix, length = entry.prefix
    return crc.combine(prefix, value, entry.nbytes) if length else value


def _describe(table: Table, bad: list[str] | None) -> dict[str, Any]:
    return {
        "path": table.path,
        "format": table.format,
        "bytes": os.path.getsize(table.path),
        "num_replicas": table.num_replicas,
        "save_counter": table.counter,
        "positions": table.positions,
        "header_checksum": table.sealed,
        "entries": [
            {
                "name": e.name,
                "dtype": str(e.dtype),
                "shape": list(e.shape),
                "bytes": e.nbytes,
                "crc32": f"{e.crc:08x}",
            }
            for e in table.entries.values()
        ],
        "verified": bad is not None,
        "mismatched": bad or [],
    }


def _text(info: dict[str, Any]) -> str:
    lines = [
        f"{info['path']}: mpistrat checkpoint, format {info['format']}, {info['bytes']} bytes",
        f"saved by {info['num_replicas']} rank(s), save_counter {info['save_counter']}",
    ]
    if not info["header_checksum"]:
        lines.append("the header has no checksum of its own (an earlier version's file)")
    lines += [f"position of {name}: {value}" for name, value in info["positions"].items()]
    entries = info["entries"]
    width = max([len(e["name"]) for e in entries] + [5])
    lines.append(f"{'entry':<{width}}  {'dtype':<10} {'shape':<18} {'bytes':>12}  crc32")
    for e in entries:
        shape = "(" + ", ".join(map(str, e["shape"])) + ("," if len(e["shape"]) == 1 else "") + ")"
        lines.append(f"{e['name']:<{width}}  {e['dtype']:<10} {shape:<18} {e['bytes']:>12}  {e['crc32']}")
    if not info["verified"]:
        lines.append("checksums not verified (--no-verify)")
    elif info["mismatched"]:
        lines.append(
            f"CHECKSUM MISMATCH in {len(info['mismatched'])} entries: {', '.join(info['mismatched'])}"
        )
    else:
        lines.append(f"checksums: all {len(entries)} entries intact")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpistrat checkpoint", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="entries, metadata and checksums of a checkpoint file")
    inspect.add_argument("path", help="a checkpoint file (or a directory: its latest checkpoint)")
    inspect.add_argument("--no-verify", action="store_true", help="do not read the data to check it")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    path = args.path
    if os.path.isdir(path):
        from mpistrat.checkpoint.files import checkpoint_state

        path = checkpoint_state(path)[0] or ""
        if not path:
            print(f"mpistrat checkpoint: {args.path} holds no checkpoint (no index)", file=sys.stderr)
            return 2
    try:
        table = read_table(path)
    except (OSError, InvalidArgumentError) as exc:
        print(f"mpistrat checkpoint: {exc}", file=sys.stderr)
        return 2
    if table is None:
        print(f"mpistrat checkpoint: {path} is not an mpistrat checkpoint", file=sys.stderr)
        return 2
    info = _describe(table, None if args.no_verify else verify(table))
    print(json.dumps(info, indent=1) if args.json else _text(info))
    return 1 if info["mismatched"] else 0
