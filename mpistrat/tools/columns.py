"""Rows of text cells as aligned columns, the way ``mpistrat info`` prints its per-rank tables.

>>> print("\\n".join(columns(("rank", "host"), [("0", "node-a"), ("10", "b")])))
rank  host
0     node-a
10    b
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["columns"]


def columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """``header`` and ``rows`` as lines, each column as wide as its widest cell, two spaces apart."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
