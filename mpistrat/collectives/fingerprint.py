"""Every code the ranks compare: one hash of text, one memo of codes, checksums of array bytes.

The handshake compares numbers, not arguments: each collective reduces its kind and its
arguments (structure, dtypes, shapes, options) to 62-bit codes that are equal on every
rank exactly when the arguments are (up to a hash collision). :func:`hash64` is the one
hash; :func:`cached_code` the one memo in front of it (a training loop repeats the same
calls, and a lookup is several times cheaper than formatting the text to hash).
:func:`code_of` and :func:`arrays_code` say what goes into a code; :func:`checksum`
compares the contents of arrays (variables' copies, the rows of a global batch).

>>> code_of("SUM", (3,)) == code_of("SUM", (3,)) != code_of("SUM", (4,))
True
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

try:  # hashlib's blake2b itself: importing hashlib would also load OpenSSL (libcrypto) at every start
    from _blake2 import blake2b
except ImportError:  # an interpreter without CPython's module
    from hashlib import blake2b

import numpy as np

from mpistrat.comm import packing
from mpistrat.reduce_op import ReduceOp

__all__ = ["arrays_code", "cached_code", "checksum", "code_of", "hash64"]


def hash64(text: str) -> int:
    """A 62-bit code of ``text`` (room for its negation in the handshake's int64 slots).

    >>> hash64("all_reduce") == hash64("all_reduce") != hash64("all_gather")
    True
    """
    return int.from_bytes(blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def cached_code(memo: Any, key: Any, text: Callable[[], str]) -> int:
    """``hash64(text())``, remembered in ``memo`` (a ``Memo``, or None) under the hashable ``key``.

    >>> from mpistrat.collectives.caches import Memo
    >>> memo = Memo(limit=8)
    >>> cached_code(memo, "kind", lambda: "kind") == hash64("kind") == memo["kind"]
    True
    """
    if memo is None:
        return hash64(text())
    code = memo.get(key)
    if code is None:
        code = memo.keep(key, hash64(text()))
    return code


def code_of(*parts: Any, memo: Any = None) -> int:
    """The code of hashable ``parts``: the same on every rank for equal parts.

    ``memo`` (``Collectives.caches.codes``) remembers it under ``parts``.
    """
    return cached_code(memo, parts, lambda: repr(parts))


def arrays_code(
    memo: Any,
    op: ReduceOp | None,
    impl: str | None,
    treespec: Any,
    arrays: list[Any],
    sig: Any = None,
    bytes_per_pack: int = 0,
) -> int:
    """The code of a collective's arguments: (op, implementation, packing, structure, dtypes, shapes).

    ``bytes_per_pack`` is in it because ranks that split a nest differently would hand MPI
    buffers of different sizes.

    ``sig`` (plain NumPy arrays: their (dtype, shape) pairs) is only a cheaper cache key:
    the code itself comes from the same text either way, so both paths agree.
    """
    key = (
        op,
        impl,
        bytes_per_pack,
        treespec,
        sig if sig is not None else tuple((packing.dtype_name(a), a.shape) for a in arrays),
    )
    return cached_code(
        memo,
        key,
        lambda: repr(
            (op, impl, bytes_per_pack, str(treespec), [(packing.dtype_name(a), a.shape) for a in arrays])
        ),
    )


def checksum(arr: Any) -> int:
    """A 63-bit checksum of an array's bytes (CRC-32 and Adler-32 side by side), the same for
    equal bytes on every rank.

    >>> checksum(np.arange(3.0)) == checksum(np.arange(3.0)) != checksum(np.arange(1.0, 4.0))
    True
    """
    host = np.ascontiguousarray(arr if packing.array_module(arr) is np else arr.get())
    data = host.reshape(-1).view(np.uint8).data
    return ((zlib.crc32(data) << 31) ^ zlib.adler32(data)) & (2**63 - 1)
