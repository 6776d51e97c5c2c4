"""``mpistrat checkpoint inspect PATH``: what a checkpoint file holds, and whether its bytes are intact.

Prints the format, the rank count and save counter it was written with, where each dataset stands
(its epoch, the batches and examples taken in it, its shuffling seed), and one row per entry
(dtype, shape, bytes, CRC-32C: CRC-32 in files of earlier versions), then checks every entry's
checksum, reading the file once in pieces (``--no-verify`` skips that); the header's own
checksum is checked first.
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
from typing import Any

import numpy as np

from mpistrat.checkpoint.files import read_table
from mpistrat.checkpoint.format import Entry, Table
from mpistrat.errors import InvalidArgumentError
from mpistrat.input import saved_row

__all__ = ["main", "verify"]

_CHUNK = 16 << 20


def verify(table: Table) -> list[str]:
    """The names of the entries whose bytes do not match their checksums (the file read once)."""
    bad = []
    with open(table.path, "rb") as f:
        for entry in table.entries.values():
            if _checksum(f, entry, table) != entry.crc:
                bad.append(entry.name)
    return bad


def _checksum(f: Any, entry: Entry, table: Table) -> int:
    f.seek(entry.offset)
    value, left = 0, entry.nbytes
    while left:
        chunk = f.read(min(left, _CHUNK))
        if not chunk:
            return -1  # shorter than its header says
        value, left = table.checksum(chunk, value), left - len(chunk)
    prefix, length = entry.prefix
    return table.checksum.combine(prefix, value, entry.nbytes) if length else value


def _describe(table: Table, bad: list[str] | None) -> dict[str, Any]:
    return {
        "path": table.path,
        "format": table.format,
        "bytes": os.path.getsize(table.path),
        "num_replicas": table.num_replicas,
        "save_counter": table.counter,
        "positions": table.positions,
        "header_checksum": table.sealed,
        "datasets": {name: _dataset(table, name) for name in table.positions},
        "checksum": table.checksum.key,
        "entries": [
            {
                "name": e.name,
                "dtype": str(e.dtype),
                "shape": list(e.shape),
                "bytes": e.nbytes,
                table.checksum.key: f"{e.crc:08x}",
            }
            for e in table.entries.values()
        ],
        "verified": bad is not None,
        "mismatched": bad or [],
    }


def _dataset(table: Table, name: str) -> Any:
    """A dataset's position in words: what the file says of it (the epoch, the batches and examples
    taken, the seed), else what its row says (a file of an earlier version, or per-rank input: one
    for each rank); None where the row cannot be read."""
    if name in table.datasets:
        return table.datasets[name]
    rows = np.asarray(table.positions[name])
    if rows.ndim == 2:
        return [_decoded(row) for row in rows]
    return _decoded(rows)


def _decoded(row: Any) -> dict[str, Any]:
    saved = saved_row.decode(row)
    return {"epoch": saved.epoch, "batches": saved.batches, "examples": saved.examples, "seed": None}


def _said(about: Any) -> str:
    """``epoch 3, 17 batches and 1088 examples taken, seed 7``; for a list, each rank's.

    >>> _said({"epoch": 3, "batches": 17, "examples": 1088, "seed": 7})
    'epoch 3, 17 batches and 1088 examples taken, seed 7'
    """
    if isinstance(about, list):
        return "; ".join(f"rank {r}: {_said(one)}" for r, one in enumerate(about))
    counts = ((about.get("batches"), "batches"), (about.get("examples"), "examples"))
    taken = " and ".join(f"{n} {what}" for n, what in counts if n is not None) or "nothing"
    seed = about.get("seed")
    return f"epoch {about['epoch']}, {taken} taken, " + (
        f"seed {seed}" if seed is not None else "no seed recorded (not shuffled, or its order is its own)"
    )


def _text(info: dict[str, Any]) -> str:
    lines = [
        f"{info['path']}: mpistrat checkpoint, format {info['format']}, {info['bytes']} bytes",
        f"saved by {info['num_replicas']} rank(s), save_counter {info['save_counter']}",
    ]
    if not info["header_checksum"]:
        lines.append("the header has no checksum of its own (an earlier version's file)")
    lines += [f"position of {name}: {_said(about)}" for name, about in info["datasets"].items()]
    entries = info["entries"]
    width = max([len(e["name"]) for e in entries] + [5])
    key = info["checksum"]
    lines.append(f"{'entry':<{width}}  {'dtype':<10} {'shape':<18} {'bytes':>12}  {key}")
    for e in entries:
        shape = "(" + ", ".join(map(str, e["shape"])) + ("," if len(e["shape"]) == 1 else "") + ")"
        lines.append(f"{e['name']:<{width}}  {e['dtype']:<10} {shape:<18} {e['bytes']:>12}  {e[key]}")
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
