"""Pickled transfers to and from rank 0: what merge_call, checkpoints and other coordination use.

Objects are pickled with protocol 5 and their NumPy arrays' bytes out of band (CuPy
arrays through host memory). Up to ``INLINE_BYTES`` of array bytes ride inside the
pickled message (one collective); above, they follow raw in one ``Gatherv``, ``Bcast``
or ``Scatterv``. An object that cannot be pickled is an error on every rank.
:func:`on_root` runs a function on rank 0 and gives every rank its result or its error.

>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> Collectives(MPI.COMM_SELF.Dup()).on_root(lambda: {"step": 3}, kind="example")
{'step': 3}
"""

from __future__ import annotations

import io
import itertools
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.handshake import check_enabled
from mpistrat.comm import packing
from mpistrat.diagnostics import watchdog
from mpistrat.errors import UnsupportedTypeError, portable

if TYPE_CHECKING:
    from mpistrat.collectives.state import CollectiveState

__all__ = [
    "INLINE_BYTES",
    "Unsendable",
    "broadcast_from_root",
    "gather_to_root",
    "on_root",
    "scatter_from_root",
]

# Array bytes up to this size travel inside the pickled message: one collective instead of
# two, which is what small merge_call arguments cost.
INLINE_BYTES = 1 << 16

_NO_BYTES = np.empty(0, dtype=np.uint8)  # what a rank with no raw bytes sends


@watchdog.collective("merge_call")
def gather_to_root(
    self: CollectiveState, obj: Any, root: int = 0, *, kind: str = "merge_call"
) -> list[Any] | None:
    """Every rank's ``obj`` on ``root`` (a list in rank order), None elsewhere.

    Objects are pickled with their array bytes out of band: a rank's bytes ride in
    one ``gather`` of the pickles up to ``INLINE_BYTES``, and larger ones follow in
    one ``Gatherv`` (the handshake tells every rank whether any rank needs it).
    """
    header, data, error = _split_or_fail(
        obj, f"{kind}: the arguments cannot be pickled to send to rank {root}"
    )
    inline = data.size <= INLINE_BYTES
    # Without the check, an error travels in the pickled message instead: root raises it for all.
    raw = self.agree(kind, error=error if check_enabled(self) else None, maximum=0 if inline else 1)
    if raw is None:  # unknown without the check: the Gatherv always follows
        raw = 1
    if self.rank != root:
        self.comm.gather((header, data.tobytes() if inline else data.size), root=root)
        if raw:
            self.comm.Gatherv([data if not inline else _NO_BYTES, MPI.BYTE], None, root=root)
        return None
    # On root ``gather`` returns the list (``None`` is for the others); root's own entry is ``obj``.
    messages = cast("list[Any]", self.comm.gather(None, root=root))
    sizes = [m[1] if r != root and not isinstance(m[1], bytes) else 0 for r, m in enumerate(messages)]
    displs = [0, *itertools.accumulate(sizes[:-1])]
    everything = np.empty(sum(sizes), dtype=np.uint8)
    if raw:
        self.comm.Gatherv([_NO_BYTES, MPI.BYTE], [everything, sizes, displs, MPI.BYTE], root=root)
    gathered = []
    for r, message in enumerate(messages):
        if r == root:
            gathered.append(obj)
            continue
        h, payload = message
        if isinstance(payload, bytes):
            buf = np.frombuffer(bytearray(payload), dtype=np.uint8)  # writable, private
        else:
            buf = everything[displs[r] : displs[r] + payload]
        try:
            gathered.append(_join_arrays(h, buf))
        except Exception as exc:  # the caller raises it on every rank (merge_call: through on_root)
            gathered.append(
                Unsendable(f"rank {r}'s arguments cannot be unpickled: {type(exc).__name__}: {exc}")
            )
    return gathered


@watchdog.collective("broadcast_from_root")
def broadcast_from_root(
    self: CollectiveState, obj: Any = None, root: int = 0, *, kind: str = "broadcast_from_root"
) -> Any:
    """``obj`` from ``root`` on every rank: pickled, with array bytes inside the message up
    to ``INLINE_BYTES`` and as one raw ``Bcast`` above."""
    if self.rank == root:  # root keeps ``obj``; it pickles only for the others
        header, data, error = _split_or_fail(obj, f"rank {root}'s value for every rank cannot be pickled")
        inline = data.size <= INLINE_BYTES
        self.comm.bcast((header, data.tobytes() if inline else data.size), root=root)
        if not inline:
            self.comm.Bcast([data, MPI.BYTE], root=root)
        if error is not None:
            raise error
        return obj
    header, payload = self.comm.bcast(None, root=root)
    if isinstance(payload, bytes):
        data = np.frombuffer(bytearray(payload), dtype=np.uint8)  # writable, private
    else:
        data = np.empty(payload, dtype=np.uint8)
        self.comm.Bcast([data, MPI.BYTE], root=root)
    return _received(header, data)


@watchdog.collective("scatter_from_root")
def scatter_from_root(
    self: CollectiveState, objs: list[Any] | None = None, root: int = 0, *, kind: str = "scatter_from_root"
) -> Any:
    """``objs[r]`` (given on ``root``) on rank ``r``: each rank receives only its own object.

    Pickled as :meth:`gather_to_root` does; large array bytes follow in one ``Scatterv``
    (root says in each message whether it comes, and whether any object failed to
    pickle: then every rank raises).
    """
    if self.rank != root:
        header, payload, raw, failure = self.comm.scatter(None, root=root)
        data = np.empty(0 if isinstance(payload, bytes) else payload, dtype=np.uint8)
        if raw:
            self.comm.Scatterv(None, [data, MPI.BYTE], root=root)
        if failure is not None:
            raise UnsupportedTypeError(failure)
        if isinstance(payload, bytes):
            data = np.frombuffer(bytearray(payload), dtype=np.uint8)  # writable, private
        return _received(header, data)
    assert objs is not None and len(objs) == self.size
    splits = [
        (None, _NO_BYTES, None)
        if r == root
        else _split_or_fail(o, f"rank {root}'s value for rank {r} cannot be pickled")
        for r, o in enumerate(objs)
    ]
    sizes = [0 if d.size <= INLINE_BYTES else d.size for _, d, _ in splits]
    raw = any(sizes)
    error = next((e for _, _, e in splits if e is not None), None)
    failure = None if error is None else str(error)
    messages: list[tuple[Any, int | bytes, bool, str | None] | None] = [
        (h, n or d.tobytes(), raw, failure) for (h, d, _), n in zip(splits, sizes, strict=True)
    ]
    messages[root] = None
    self.comm.scatter(messages, root=root)
    if raw:
        large = np.concatenate([d for (_, d, _), n in zip(splits, sizes, strict=True) if n])
        displs = [0, *itertools.accumulate(sizes[:-1])]
        self.comm.Scatterv([large, sizes, displs, MPI.BYTE], [_NO_BYTES, MPI.BYTE], root=root)
    if error is not None:
        raise error
    return objs[root]


def on_root(self: CollectiveState, fn: Callable[[], Any], root: int = 0, *, kind: str) -> Any:
    """``fn()`` run on ``root`` alone; its result, or the exception it raised, on every rank.

    Root re-raises its own exception (with its traceback); the others raise a copy
    (or a ``MergeCallError`` describing it when it cannot be pickled).
    """
    payload: Any = None
    if self.rank == root:
        try:
            payload = ("ok", fn())
        except BaseException as exc:  # every rank must hear of it, whatever it is
            payload, original = ("error", portable(exc)), exc
    status, value = broadcast_from_root(self, payload, root, kind=kind)
    if status == "error":
        if self.rank == root:
            raise original
        raise value
    return value


class Unsendable:
    """Sent in place of an object that could not be pickled, so the receivers raise instead of hanging."""

    def __init__(self, message: str):
        self.message = message


def _split_or_fail(obj: Any, what: str) -> tuple[Any, np.ndarray, UnsupportedTypeError | None]:
    try:
        header, data = _split_arrays(obj)
        # What the receivers will do: an object that pickles but does not unpickle (an exception
        # whose __init__ takes other arguments) fails here, where every rank can be told.
        _join_arrays(header, data)
        return header, data, None
    except Exception as exc:
        error = UnsupportedTypeError(f"{what}: {type(exc).__name__}: {exc}")
        return (*_split_arrays(Unsendable(str(error))), error)


def _split_arrays(obj: Any) -> tuple[tuple[bytes, list[int]], np.ndarray]:
    """Pickle ``obj`` with the bytes of its NumPy arrays out of band (protocol 5).

    Returns (the pickle, each out-of-band buffer's size) and those buffers joined in one
    byte array: what travels raw. CuPy arrays pickle through host memory and come back
    on the receiver's current device.
    """
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
    header = stream.getvalue()
    if not buffers:
        return (header, []), _NO_BYTES
    raws = [np.frombuffer(b.raw(), dtype=np.uint8) for b in buffers]
    return (header, [r.size for r in raws]), np.concatenate(raws)


class _Pickler(pickle.Pickler):
    """Protocol-5 pickler that moves CuPy arrays through host memory explicitly."""

    def reducer_override(self, obj: Any) -> Any:
        if packing.is_device_array(obj):
            return _to_device, (obj.get(),)
        return NotImplemented


def _to_device(host: np.ndarray) -> Any:
    import cupy

    return cupy.asarray(host)


def _received(header: tuple[bytes, list[int]], data: np.ndarray) -> Any:
    """What root sent, or the error it could not send."""
    result = _join_arrays(header, data)
    if isinstance(result, Unsendable):
        raise UnsupportedTypeError(result.message)
    return result


def _join_arrays(header: tuple[bytes, list[int]], data: np.ndarray) -> Any:
    """Unpickle what ``_split_arrays`` made; arrays become views of ``data`` (a private buffer)."""
    pickled, sizes = header
    if not sizes:
        return pickle.loads(pickled)
    bounds = [0, *itertools.accumulate(sizes)]
    return pickle.loads(pickled, buffers=[data[a:b] for a, b in itertools.pairwise(bounds)])
