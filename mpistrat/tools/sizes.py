"""Message sizes as the tools' command lines spell them.

>>> [parse_size(s) for s in ("4", "64K", "64KiB", "64kb", "1M", "1MB", "1MiB", "1g", "1GiB")]
[4, 65536, 65536, 65536, 1048576, 1048576, 1048576, 1073741824, 1073741824]
"""

from __future__ import annotations

import argparse
import re

__all__ = ["parse_size"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"\s*(\d+)\s*([KMG]?)(I?B)?\s*")


def parse_size(text: str) -> int:
    """Bytes from a size: a positive whole number, then K, M or G (powers of 1024), then B or iB.

    Any case; ``64K``, ``64KB``, ``64kb`` and ``64KiB`` are all 65536 bytes. An ``argparse``
    ``type=``: a size it cannot read raises ``argparse.ArgumentTypeError`` naming what came.

    >>> parse_size("4"), parse_size("4B"), parse_size("256mib"), parse_size("2G")
    (4, 4, 268435456, 2147483648)
    >>> parse_size("1.5M")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: expected a size like 4, 64K, 64KiB, 1MB or 1g (...); got '1.5M'
    """
    match = _SIZE.fullmatch(text.upper())
    if not match or int(match[1]) <= 0 or (match[3] == "IB" and not match[2]):
        raise argparse.ArgumentTypeError(
            "expected a size like 4, 64K, 64KiB, 1MB or 1g "
            f"(a positive whole number of bytes, K, M, G are powers of 1024); got {text!r}"
        )
    return int(match[1]) * _UNITS[match[2]]
