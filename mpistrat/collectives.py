"""Nest-level collectives over one private communicator.

Every collective is numbered (a per-communicator sequence) and, while checking is
on, opens with a *handshake*: one small fixed-size ``Allgather`` of
``[magic, seq, kind, fingerprint, error, extras...]``. Every rank sees every
rank's header, so a mismatch (different collective, nest structure, dtypes,
shapes, reduce op) or bad input on any one rank is raised on every rank instead
of deadlocking. ``all_gather`` needs the per-rank sizes anyway, so for it the
handshake is the size exchange and costs nothing extra.

>>> from mpi4py import MPI
>>> c = Collectives(MPI.COMM_SELF.Dup())
>>> c.all_reduce("sum", {"a": 1, "b": [40, 1]})
{'a': np.int64(1), 'b': [np.int64(40), np.int64(1)]}
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import os
import pickle
import zlib
from typing import Any

import numpy as np
import optree
from mpi4py import MPI

from mpistrat import nest
from mpistrat.comm import packing
from mpistrat.comm.mpi import buffer_spec, mpi_datatype, synchronize
from mpistrat.errors import (
    CollectiveMismatchError,
    InvalidArgumentError,
    MpistratError,
)
from mpistrat.options import CommunicationOptions
from mpistrat.reduce_op import ReduceOp

__all__ = ["Collectives", "check_enabled"]

_MAGIC = 0x6D707374  # "mpst"
# Array bytes up to this size travel inside gather_to_root/broadcast_from_root's pickled
# message: one collective instead of two, which is what small merge_call arguments cost.
_INLINE_BYTES = 1 << 16
_ARRAYS_TAG = 0x6D70
_HEADER = 16
_EXTRAS = _HEADER - 6  # per-leaf sizes that fit in the handshake itself
_NEST = {"none_is_leaf": True, "namespace": "mpistrat"}


def check_enabled(options: CommunicationOptions) -> bool:
    """Whether the handshake check runs: the option, else ``MPISTRAT_CHECK`` (default on)."""
    if options.check is not None:
        return options.check
    return _env_flag(os.environ.get("MPISTRAT_CHECK", "1"))


@functools.lru_cache(maxsize=16)
def _env_flag(value: str) -> bool:
    return value.strip().lower() not in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=64)
def _code(text: str) -> int:
    return zlib.crc32(text.encode())


_REDUCE_OPS: dict[Any, ReduceOp] = {}


def _known_reduce_op(value: Any) -> ReduceOp | None:
    """The ReduceOp for a name or member already seen, else None."""
    try:
        return _REDUCE_OPS.get(value)
    except TypeError:
        return None


def _reduce_op(value: ReduceOp | str) -> ReduceOp:
    """``ReduceOp.from_any``, remembered for the (few) names and members that are valid."""
    try:
        return _REDUCE_OPS[value]
    except (KeyError, TypeError):
        op = ReduceOp.from_any(value)
        if isinstance(value, (str, ReduceOp)):
            _REDUCE_OPS[value] = op
        return op


class Collectives:
    """Collectives on nests of arrays over ``comm`` (which the caller owns and has duplicated)."""

    def __init__(self, comm: MPI.Intracomm, options: CommunicationOptions | None = None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.options = options or CommunicationOptions()
        self.seq = 0

    # -- the handshake ---------------------------------------------------------------

    def handshake(
        self,
        kind: str,
        fingerprint: int,
        describe: Any,
        error: MpistratError | None = None,
        extras: list[int] | None = None,
    ) -> np.ndarray:
        """Agree on (seq, kind, fingerprint) with every rank; return every rank's header.

        ``describe`` is a callable returning a picklable description of this rank's
        arguments; it is only called when something disagrees, to explain what.
        """
        self.seq += 1
        header = np.zeros(_HEADER, dtype=np.int64)
        extras = extras or []
        header[:6] = (_MAGIC, self.seq, _code(kind), fingerprint, error is not None, len(extras))
        if extras:
            header[6 : 6 + min(len(extras), _EXTRAS)] = extras[:_EXTRAS]
        table = np.empty((self.size, _HEADER), dtype=np.int64)
        self.comm.Allgather(header, table)
        if error is not None or not _agreed(table, header):
            self._raise_disagreement(kind, describe, error)
        if len(extras) > _EXTRAS:
            full = np.asarray(extras, dtype=np.int64)
            everyone = np.empty((self.size, len(extras)), dtype=np.int64)
            self.comm.Allgather(full, everyone)
            return everyone
        return table[:, 6 : 6 + len(extras)]

    def _raise_disagreement(self, kind: str, describe: Any, error: MpistratError | None) -> None:
        """Every rank is here: exchange descriptions and raise the same error everywhere."""
        try:
            mine = describe() if error is None else None
        except Exception as exc:  # a description must never turn an error into a hang
            mine = f"<undescribable: {exc}>"
        reports = self.comm.allgather((kind, self.seq, mine, error))
        failed = [(r, e) for r, (_, _, _, e) in enumerate(reports) if e is not None]
        if failed:
            rank, first = failed[0]
            others = "" if len(failed) == 1 else f" (and ranks {[r for r, _ in failed[1:]]})"
            raise type(first)(f"{kind}: rank {rank}{others}: {first}")
        kinds = {(k, s) for k, s, _, _ in reports}
        if len(kinds) > 1:
            calls = "; ".join(
                f"rank {r} called {k} (collective #{s})" for r, (k, s, _, _) in enumerate(reports)
            )
            raise CollectiveMismatchError(
                f"ranks are in different collectives: {calls}. Every rank must call the same "
                "collectives in the same order."
            )
        raise CollectiveMismatchError(f"{kind}: {_first_difference([d for _, _, d, _ in reports])}")

    # -- all_reduce ------------------------------------------------------------------

    def all_reduce(
        self,
        reduce_op: ReduceOp | str,
        value: Any,
        options: CommunicationOptions | None = None,
        kind: str = "all_reduce",
    ) -> Any:
        """Reduce a nest of arrays/numbers across ranks; same structure, dtype (SUM) out."""
        if options is None and type(value) is np.ndarray:
            op = _known_reduce_op(reduce_op)
            if op is not None and value.dtype.kind in "iufc":
                return self._all_reduce_array(op, value, kind)
        opts = self.options.merge(options)
        error, op, leaves, treespec, arrays = None, None, [], None, []
        try:
            op = _reduce_op(reduce_op)
            leaves, treespec = _flatten(value)
            arrays = to_arrays(value, leaves, kind)
        except MpistratError as exc:
            error = exc
        numpy_only = arrays is leaves  # to_arrays passes lists of plain NumPy arrays through
        fingerprint, packs = 0, None
        if numpy_only:
            fingerprint, packs = _numpy_plan(op, treespec, arrays, opts.bytes_per_pack)
        if check_enabled(opts):
            if not numpy_only:
                fingerprint = _fingerprint(op, treespec, arrays)
            self.handshake(kind, fingerprint, lambda: _describe(value, op), error)
        elif error is not None:
            raise error
        divisor = self.size if op is ReduceOp.MEAN else None
        out = self._allreduce_arrays(arrays, opts.bytes_per_pack, divisor, packs)
        if not numpy_only:  # numbers come back as NumPy scalars
            out = [
                o if isinstance(x, np.ndarray) or packing.array_module(x) is not np else o[()]
                for x, o in zip(leaves, out, strict=True)
            ]
        return optree.tree_unflatten(treespec, out)

    def _all_reduce_array(self, op: ReduceOp, x: np.ndarray, kind: str) -> np.ndarray:
        """``all_reduce`` of one valid NumPy array: the same steps without the nest bookkeeping."""
        fingerprint, packs = _numpy_plan(op, _LEAF_SPEC, [x], self.options.bytes_per_pack)
        if check_enabled(self.options):
            self.handshake(kind, fingerprint, lambda: _describe(x, op))
        divisor = self.size if op is ReduceOp.MEAN else None
        return self._allreduce_arrays([x], self.options.bytes_per_pack, divisor, packs)[0]

    def _allreduce_arrays(
        self, arrays: list[Any], bytes_per_pack: int, divisor: int | None = None, packs: Any = None
    ) -> list[Any]:
        """Sum across ranks, one MPI call per pack; a ``divisor`` divides each pack once (MEAN).

        ``packs``: the plan for plain NumPy ``arrays`` if the caller has it (``_numpy_plan``).
        """
        if packs is None:
            synchronize(arrays)
            packs = packing.plan_packs(arrays, bytes_per_pack)
        out: list[Any] = [None] * len(arrays)
        for p in packs:
            if len(p.indices) == 1 and packing.is_contiguous(arrays[p.indices[0]]):
                i = p.indices[0]
                recv = packing.empty(arrays[i].shape, p.dtype, p.module)
                self.comm.Allreduce(buffer_spec(arrays[i]), buffer_spec(recv), op=MPI.SUM)
                out[i] = recv if divisor is None else _divide(recv, divisor)
            else:
                buf = packing.pack(arrays, p)
                synchronize([buf])
                self.comm.Allreduce(MPI.IN_PLACE, buffer_spec(buf), op=MPI.SUM)
                packing.unpack(buf if divisor is None else _divide(buf, divisor), arrays, p, out)
        return out

    # -- all_gather ------------------------------------------------------------------

    def all_gather(
        self,
        value: Any,
        axis: int,
        options: CommunicationOptions | None = None,
        kind: str = "all_gather",
    ) -> Any:
        """Concatenate every rank's arrays along ``axis``; sizes along ``axis`` may differ."""
        if options is None and type(value) is np.ndarray and type(axis) is int and _gatherable(value, axis):
            return self._all_gather_array(value, axis, kind)
        opts = self.options.merge(options)
        error, leaves, treespec, arrays, axes = None, [], None, [], []
        try:
            if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
                raise InvalidArgumentError(f"{kind}: axis must be an int; got {axis!r}")
            leaves, treespec = _flatten(value)
            arrays = to_arrays(value, leaves, kind)
            for i, arr in enumerate(arrays):
                if arr.ndim == 0:
                    problem = "all_gather needs arrays of rank >= 1 to concatenate; got a scalar"
                elif not -arr.ndim <= axis < arr.ndim:
                    problem = f"axis {axis} is out of range for shape {arr.shape}"
                else:
                    axes.append(int(axis) % arr.ndim)
                    continue
                raise InvalidArgumentError(f"{kind}: leaf {_leaf_path(value, i)}: {problem}")
        except MpistratError as exc:
            error, arrays, axes = exc, [], []
        fingerprint = _gather_fingerprint(treespec, arrays, axes)
        sizes = self.handshake(
            kind,
            fingerprint,
            lambda: _describe(value, None, axis),
            error,
            extras=[a.shape[ax] for a, ax in zip(arrays, axes, strict=True)],
        )
        moved = [np_moveaxis(a, ax) for a, ax in zip(arrays, axes, strict=True)]
        out: list[Any] = [None] * len(arrays)
        if not packing.all_numpy(moved):
            synchronize(moved)
        for p in packing.plan_packs(moved, opts.bytes_per_pack):
            self._allgather_pack(moved, p, sizes, out)
        out = [
            o
            if ax == 0
            else packing.array_module(o).ascontiguousarray(packing.array_module(o).moveaxis(o, 0, ax))
            for o, ax in zip(out, axes, strict=True)
        ]
        return optree.tree_unflatten(treespec, out)

    def _all_gather_array(self, x: np.ndarray, axis: int, kind: str) -> np.ndarray:
        """``all_gather`` of one valid NumPy array: the same steps without the nest bookkeeping."""
        ax = axis % x.ndim
        fingerprint = _gather_fingerprint(_LEAF_SPEC, [x], [ax])
        sizes = self.handshake(kind, fingerprint, lambda: _describe(x, None, axis), None, [x.shape[ax]])
        moved = [x if ax == 0 else np.moveaxis(x, ax, 0)]
        out: list[Any] = [None]
        for p in packing.plan_packs(moved, self.options.bytes_per_pack):
            self._allgather_pack(moved, p, sizes, out)
        return out[0] if ax == 0 else np.ascontiguousarray(np.moveaxis(out[0], 0, ax))

    def _allgather_pack(self, moved: list[Any], p: Any, sizes: np.ndarray, out: list[Any]) -> None:
        xp = p.module
        rows = sizes.tolist()  # plain ints: this is per-call overhead, NumPy scalars cost more here
        inner = {i: math.prod(moved[i].shape[1:]) for i in p.indices}
        counts = [sum(row[i] * inner[i] for i in p.indices) for row in rows]
        displs = [0, *itertools.accumulate(counts[:-1])]
        recv = packing.empty((sum(counts),), p.dtype, xp)
        if len(p.indices) == 1 and packing.is_contiguous(moved[p.indices[0]]):
            send = moved[p.indices[0]]
        else:
            send = packing.pack(moved, p)
            synchronize([send])
        if counts.count(counts[0]) == len(counts):  # even: every rank saw the same counts
            self.comm.Allgather(buffer_spec(send, counts[self.rank]), [recv, mpi_datatype(recv.dtype)])
        else:
            recv_spec = [recv, counts, displs, mpi_datatype(recv.dtype)]
            self.comm.Allgatherv(buffer_spec(send, counts[self.rank]), recv_spec)
        if len(p.indices) == 1:
            i = p.indices[0]
            out[i] = recv.reshape((sum(row[i] for row in rows), *moved[i].shape[1:]))
            return
        for i in p.indices:
            pieces = []
            for r in range(self.size):
                start = displs[r] + sum(rows[r][j] * inner[j] for j in p.indices if j < i)
                n = rows[r][i]
                pieces.append(recv[start : start + n * inner[i]].reshape((n, *moved[i].shape[1:])))
            out[i] = xp.concatenate(pieces, axis=0)

    # -- objects to and from rank 0 (merge_call) ------------------------------------

    def gather_to_root(self, obj: Any, kind: str = "merge_call", root: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on ``root`` (a list in rank order), None elsewhere.

        The rest is pickled into one ``gather``. A rank's array bytes ride in that
        message up to ``_INLINE_BYTES``; above, they follow as one raw message to root
        (root learns which from the gathered headers, so no rank has to agree first).
        """
        if check_enabled(self.options):
            self.handshake(kind, 0, lambda: None)
        header, sizes, data = _split_arrays(obj)
        inline = data.size <= _INLINE_BYTES
        messages = self.comm.gather((header, sizes, data.tobytes() if inline else data.size), root=root)
        if self.rank != root:
            if not inline:
                self.comm.Send([data, MPI.BYTE], dest=root, tag=_ARRAYS_TAG)
            return None
        gathered = []
        for r, (h, n, payload) in enumerate(messages):
            if isinstance(payload, bytes):
                buf = np.frombuffer(bytearray(payload), dtype=np.uint8) if n else _NO_BYTES
            elif r == root:
                buf = data
            else:
                buf = np.empty(payload, dtype=np.uint8)
                self.comm.Recv([buf, MPI.BYTE], source=r, tag=_ARRAYS_TAG)
            gathered.append(_join_arrays(h, n, buf))
        return gathered

    def broadcast_from_root(self, obj: Any = None, root: int = 0) -> Any:
        """``obj`` from ``root`` on every rank: pickled, with arrays as raw bytes inside the
        message up to ``_INLINE_BYTES`` and as one raw ``Bcast`` above."""
        if self.rank == root:
            header, sizes, data = _split_arrays(obj)
            inline = data.size <= _INLINE_BYTES
            self.comm.bcast((header, sizes, data.tobytes() if inline else data.size), root=root)
            if not inline:
                self.comm.Bcast([data, MPI.BYTE], root=root)
            return _join_arrays(header, sizes, data)
        header, sizes, payload = self.comm.bcast(None, root=root)
        if isinstance(payload, bytes):
            data = np.frombuffer(bytearray(payload), dtype=np.uint8) if sizes else _NO_BYTES
        else:
            data = np.empty(payload, dtype=np.uint8)
            self.comm.Bcast([data, MPI.BYTE], root=root)
        return _join_arrays(header, sizes, data)


# -- helpers ------------------------------------------------------------------------


def np_moveaxis(arr: Any, axis: int) -> Any:
    return arr if axis == 0 else packing.array_module(arr).moveaxis(arr, axis, 0)


def _leaf_path(value: Any, index: int) -> str:
    return nest.path_str(nest.flatten_with_paths(value)[index][0])


def to_arrays(value: Any, leaves: list[Any], kind: str) -> list[Any]:
    """The leaves as arrays; on bad input, an error naming the leaf's key path."""
    try:
        return packing.as_arrays(leaves)
    except MpistratError:
        for path, leaf in nest.flatten_with_paths(value):
            packing.as_array(leaf, f"{kind}: leaf {nest.path_str(path)}")
        raise


_FINGERPRINTS: dict[tuple[Any, ...], int] = {}
_DTYPE_SHAPE = operator.attrgetter("dtype", "shape")


def _cached_code(key: tuple[Any, ...], text: Any) -> int:
    """``_code(text())``, computed once per process for each ``key`` (a hashable stand-in for it)."""
    code = _FINGERPRINTS.get(key)
    if code is None:
        code = _code(text())
        if len(_FINGERPRINTS) >= 1024:
            _FINGERPRINTS.clear()
        _FINGERPRINTS[key] = code
    return code


def _fingerprint(op: ReduceOp | None, treespec: Any, arrays: list[Any], sig: Any = None) -> int:
    """A code for (op, structure, dtypes, shapes) that is the same on every rank."""
    return _cached_code(
        (op, treespec, sig if sig is not None else tuple(map(_DTYPE_SHAPE, arrays))),
        lambda: repr((op, treespec, [(a.dtype.str, a.shape) for a in arrays])),
    )


def _gather_fingerprint(treespec: Any, arrays: list[Any], axes: list[int]) -> int:
    """all_gather's code for (structure, dtypes, axes, shapes but the axis) — what ranks must share."""
    rests = [_rest(a.shape, ax) for a, ax in zip(arrays, axes, strict=True)]
    parts = list(zip(arrays, axes, rests, strict=True))
    key = ("all_gather", treespec, *[(a.dtype, ax, r) for a, ax, r in parts])
    return _cached_code(key, lambda: repr((treespec, [(a.dtype.str, ax, r) for a, ax, r in parts])))


def _gatherable(x: np.ndarray, axis: int) -> bool:
    """A numeric array of rank >= 1 that has ``axis`` (else the generic path explains the error)."""
    return x.dtype.kind in "iufc" and x.ndim > 0 and -x.ndim <= axis < x.ndim


# The last plan per structure: a training loop reduces the same nests every step, and
# comparing a signature costs less than hashing it (twice) for the caches below.
_LAST_PLAN: dict[Any, tuple[Any, ...]] = {}


def _numpy_plan(
    op: ReduceOp | None, treespec: Any, arrays: list[Any], bytes_per_pack: int
) -> tuple[int, Any]:
    """(fingerprint, pack plan) for plain NumPy ``arrays``."""
    sig = tuple(map(_DTYPE_SHAPE, arrays))
    last = _LAST_PLAN.get(treespec)
    if last is not None and last[0] is op and last[1] == bytes_per_pack and last[2] == sig:
        return last[3], last[4]
    fingerprint = _fingerprint(op, treespec, arrays, sig)
    packs = packing.plan_packs(arrays, bytes_per_pack, sig)
    if len(_LAST_PLAN) >= 256:
        _LAST_PLAN.clear()
    _LAST_PLAN[treespec] = (op, bytes_per_pack, sig, fingerprint, packs)
    return fingerprint, packs


def _rest(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """The shape without ``axis`` (all_gather's ranks must agree on it)."""
    return shape[:axis] + shape[axis + 1 :]


def _agreed(table: np.ndarray, header: np.ndarray) -> bool:
    """Every rank's (magic, seq, kind, fingerprint, error flag) equals this rank's error-free header.

    (Bytes comparisons: several tiny NumPy operations would cost more than the Allgather.)
    """
    if table.tobytes() == header.tobytes() * len(table):  # the usual case: identical headers
        return True
    return table[:, :5].tobytes() == header[:5].tobytes() * len(table)


_LEAF_SPEC = optree.tree_structure(0, **_NEST)


# Flat lists, tuples and dicts of NumPy arrays (gradients, metrics) are flattened from
# remembered structures: optree spends ~0.2 us per leaf deciding that an array is a leaf.
_FLAT: dict[Any, tuple[Any, tuple[Any, ...] | None]] = {}


def _flatten(value: Any) -> tuple[list[Any], Any]:
    """``optree.tree_flatten(value)`` with the mpistrat options, faster for flat containers of arrays."""
    kind = type(value)
    if kind is np.ndarray:
        return [value], _LEAF_SPEC
    if kind is list or kind is tuple or kind is dict:
        key = (kind, tuple(value) if kind is dict else len(value))
        known = _FLAT.get(key)
        if known is not None:
            spec, order = known
            leaves = list(map(value.__getitem__, order)) if order is not None else list(value)
            if packing.all_numpy(leaves):
                return leaves, spec
    leaves, spec = optree.tree_flatten(value, **_NEST)
    flat = kind is list or kind is tuple or kind is dict
    if flat and len(leaves) == len(value) and packing.all_numpy(leaves):
        order = None
        if kind is dict:  # the keys in optree's leaf order
            order = tuple(path[0] for path in optree.tree_paths(value, **_NEST))
        if len(_FLAT) >= 256:
            _FLAT.clear()
        _FLAT[key] = (spec, order)
    return leaves, spec


def _divide(x: Any, n: int) -> Any:
    """True division (ints become float64, as ``tf.distribute`` MEAN of ints gives 49.5)."""
    xp = packing.array_module(x)
    if x.dtype.kind in "fc":
        xp.true_divide(x, n, out=x)
        return x
    return xp.true_divide(x, n)


def _describe(value: Any, op: ReduceOp | None, axis: int | None = None) -> dict[str, Any]:
    """What this rank passed, per leaf; for all_gather the (free) axis dim shows as ``*``."""
    leaves = []
    for path, leaf in nest.flatten_with_paths(value):
        try:
            arr = packing.as_array(leaf)
            shape: tuple[Any, ...] = tuple(arr.shape)
            if axis is not None and arr.ndim and -arr.ndim <= axis < arr.ndim:
                shape = tuple("*" if d == axis % arr.ndim else n for d, n in enumerate(shape))
            leaves.append((nest.path_str(path), str(arr.dtype), shape))
        except MpistratError:
            leaves.append((nest.path_str(path), type(leaf).__name__, None))
    return {"reduce_op": None if op is None else op.value, "axis": axis, "leaves": leaves}


def _first_difference(descriptions: list[Any]) -> str:
    """Name the first thing that differs between ranks' descriptions, and what each passed."""
    first = descriptions[0]
    if not isinstance(first, dict):
        return f"ranks passed different arguments: {descriptions}"
    for key in ("reduce_op", "axis"):
        seen = [d.get(key) for d in descriptions]
        if len(set(seen)) > 1:
            return f"ranks passed different {key}: " + ", ".join(
                f"rank {r}: {v!r}" for r, v in enumerate(seen)
            )
    counts = [len(d["leaves"]) for d in descriptions]
    for i in range(max(counts)):
        entries = [d["leaves"][i] if i < len(d["leaves"]) else None for d in descriptions]
        if any(e != entries[0] for e in entries):
            path = next(e[0] for e in entries if e is not None)
            what = ", ".join(
                f"rank {r}: " + ("no leaf" if e is None else f"{e[0]} dtype={e[1]} shape={e[2]}")
                for r, e in enumerate(entries)
            )
            return (
                f"the arguments differ at leaf {path} ({what}). "
                "Every rank must pass the same nest structure, dtypes and shapes"
                + (" (all_gather: all dims but axis)" if first.get("axis") is not None else "")
                + "."
            )
    return "ranks passed different arguments: " + ", ".join(
        f"rank {r}: {d}" for r, d in enumerate(descriptions)
    )


_NO_BYTES = np.empty(0, dtype=np.uint8)


def _split_arrays(obj: Any) -> tuple[bytes, list[int], np.ndarray]:
    """Pickle ``obj`` with the bytes of its contiguous NumPy arrays out of band (protocol 5).

    Returns the pickle, each out-of-band buffer's size, and those buffers joined in one
    fresh byte array (what travels raw). Object arrays and non-NumPy data stay in the pickle.
    """
    buffers: list[pickle.PickleBuffer] = []
    header = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    if not buffers:
        return header, [], _NO_BYTES
    raws = [np.frombuffer(b.raw(), dtype=np.uint8) for b in buffers]
    return header, [r.size for r in raws], np.concatenate(raws)


def _join_arrays(header: bytes, sizes: list[int], data: np.ndarray) -> Any:
    """Unpickle what ``_split_arrays`` made; arrays become views of ``data`` (keep it private)."""
    if not sizes:
        return pickle.loads(header)
    bounds = [0, *itertools.accumulate(sizes)]
    return pickle.loads(header, buffers=[data[a:b] for a, b in itertools.pairwise(bounds)])
