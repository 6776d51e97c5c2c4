"""Batches: checking them, splitting a global batch across replicas, and empty batches.

A batch is a nest (dicts, lists, tuples, namedtuples) of arrays that share a
leading batch dimension. A per-replica pipeline (``distribute_datasets_from_function``)
may instead yield unbatched elements, as ``tf.data`` pipelines do before ``batch()``:
an element with a 0-d leaf (a scalar) is taken whole, one example, as tf takes it.
A global batch of ``b`` examples is split the way
tf.distribute splits it: each replica in rank order takes the next ``ceil(b / R)``
examples until the batch runs out; replicas past the end get ``(0, ...)`` arrays.
A :class:`Batch` whose leaves are :class:`Rows` (a shuffled ``ArrayDataset``) is
gathered only where it is split, so each replica copies just its own rows.

>>> import numpy as np
>>> [replica_range(4, 3, r) for r in range(3)]
[(0, 2), (2, 4), (4, 4)]
>>> split_batch({"x": np.arange(2)}, 3, 2)
{'x': array([], dtype=int64)}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import optree

from mpistrat import nest
from mpistrat.collectives.fingerprint import cached_code
from mpistrat.comm.packing import array_module
from mpistrat.errors import CollectiveMismatchError, InvalidArgumentError

__all__ = [
    "ArraySpec",
    "Batch",
    "Rows",
    "examine",
    "replica_range",
    "split_batch",
    "fingerprint",
    "spec_fingerprint",
]


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """The type of one leaf of a per-replica element, as ``tf.TensorSpec``.

    Of a batch, ``shape[0]`` is None: the batch dimension varies (short last batches,
    empty replicas). Of an unbatched element (a pipeline of scalars), the shape is
    the leaf's whole shape, as tf's (``()`` for a scalar).

    >>> import numpy as np
    >>> spec = ArraySpec((None, 3), np.dtype("float32"))
    >>> spec.empty().shape
    (0, 3)
    >>> ArraySpec((), np.dtype("int64")).empty()
    array(0)
    """

    shape: tuple[int | None, ...]
    dtype: np.dtype
    module: str = "numpy"

    @property
    def batched(self) -> bool:
        """Whether this is a leaf of a batch (its leading dimension is the batch's, of no fixed size)."""
        return bool(self.shape) and self.shape[0] is None

    def empty(self) -> Any:
        """What a replica whose pipeline ran out gets: tf's dummy for this spec.

        A batch with no examples (the leading dimension 0); for an unbatched leaf, as tf:
        its leading dimension set to 0, and a scalar ``0`` for a scalar.
        """
        if self.module == "cupy":
            import cupy as xp
        else:
            xp = np
        if not self.shape:
            return xp.zeros((), dtype=self.dtype)
        return xp.empty((0, *self.shape[1:]), dtype=self.dtype)

    def __repr__(self) -> str:
        return f"ArraySpec(shape={self.shape}, dtype={self.dtype.name})"


class Rows:
    """Rows ``index`` of ``array``, gathered only when sliced: ``rows[i:j]`` is ``array[index[i:j]]``.

    A leaf of a :class:`Batch` that :func:`split_batch` cuts without gathering the
    whole batch first: a replica copies only its own rows.

    >>> rows = Rows(np.arange(10) * 10, np.array([7, 2, 5]))
    >>> rows.shape, rows[1:].tolist()
    ((3,), [20, 50])
    """

    def __init__(self, array: Any, index: np.ndarray):
        self.array = array
        self.index = index
        self.shape: tuple[int, ...] = (len(index), *array.shape[1:])
        self.dtype: np.dtype = array.dtype

    def __getitem__(self, key: slice) -> Any:
        return self.array[self.index[key]]

    def __repr__(self) -> str:
        return f"Rows({self.shape}, {self.dtype})"


@dataclasses.dataclass
class Batch:
    """A checked batch: its leaves (arrays or :class:`Rows`), its structure and its number of examples.

    ``batched`` is False for an unbatched element (one example, leaves of any shape).
    """

    leaves: list[Any]
    treespec: Any
    size: int
    batched: bool = True

    @property
    def value(self) -> Any:
        """The batch as a nest of arrays (:class:`Rows` gathered)."""
        return optree.tree_unflatten(self.treespec, [a[:] if isinstance(a, Rows) else a for a in self.leaves])

    @property
    def spec(self) -> Any:
        """The element spec: the same nest with an :class:`ArraySpec` per leaf."""
        if not self.batched:
            specs = [ArraySpec(tuple(a.shape), a.dtype, _module(a)) for a in self.leaves]
        else:
            specs = [ArraySpec((None, *a.shape[1:]), a.dtype, _module(a)) for a in self.leaves]
        return optree.tree_unflatten(self.treespec, specs)


def _module(leaf: Any) -> str:
    array = leaf.array if isinstance(leaf, Rows) else leaf
    return "cupy" if array_module(array) is not np else "numpy"


def _as_batch_leaf(leaf: Any) -> Any:
    if isinstance(leaf, np.ndarray) or array_module(leaf) is not np:
        return leaf
    return np.asarray(leaf)


def examine(batch: Any, where: str, unbatched: bool = False) -> Batch:
    """Check that ``batch`` is a nest of arrays sharing a leading dimension (a :class:`Batch` already is).

    With ``unbatched`` (a per-replica pipeline), an element with a 0-d leaf is one
    unbatched example, whatever its other leaves' shapes, as a ``tf.data`` element.

    >>> examine({"a": np.arange(2), "b": np.zeros((2, 3))}, "dataset").size
    2
    >>> element = examine({"x": np.zeros(3), "y": 1}, "dataset", unbatched=True)
    >>> element.batched, element.size, element.spec["x"].shape
    (False, 1, (3,))
    """
    if isinstance(batch, Batch):
        return batch
    leaves, treespec = nest.tree_flatten(batch)
    if not leaves:
        raise InvalidArgumentError(
            f"{where}: a batch has no arrays in it (got {batch!r}); yield a nest of arrays"
        )
    paths = None
    arrays = []
    for i, leaf in enumerate(leaves):
        try:
            arr = _as_batch_leaf(leaf)
        except Exception as exc:
            paths = paths or nest.flatten_with_paths(batch)
            raise InvalidArgumentError(
                f"{where}: leaf {nest.path_str(paths[i][0])} of a batch cannot be made an array: {exc}"
            ) from exc
        arrays.append(arr)
    scalar = next((i for i, a in enumerate(arrays) if a.ndim == 0), None)
    if scalar is not None:
        if unbatched:
            return Batch(arrays, treespec, 1, batched=False)
        paths = nest.flatten_with_paths(batch)
        raise InvalidArgumentError(
            f"{where}: leaf {nest.path_str(paths[scalar][0])} of a batch is a scalar "
            f"({leaves[scalar]!r}); every leaf of a global batch needs a leading batch dimension (batch "
            "the dataset before distributing it, or yield unbatched elements from a per-replica pipeline "
            "of distribute_datasets_from_function; a list is a nest, so turn a batch given as a list into "
            "an array with np.asarray)"
        )
    sizes = [int(a.shape[0]) for a in arrays]
    if len(set(sizes)) > 1:
        paths = nest.flatten_with_paths(batch)
        found = ", ".join(f"{nest.path_str(p)}: {n}" for (p, _), n in zip(paths, sizes, strict=True))
        raise InvalidArgumentError(
            f"{where}: the leaves of a batch have different leading (batch) dimensions ({found}); "
            "every leaf must hold the same number of examples"
        )
    return Batch(arrays, treespec, sizes[0])


def replica_range(batch_size: int, num_replicas: int, replica: int) -> tuple[int, int]:
    """The examples ``[start, stop)`` of a global batch that ``replica`` takes."""
    per = -(-batch_size // num_replicas)
    start = min(replica * per, batch_size)
    return start, min(start + per, batch_size)


def split_batch(batch: Any, num_replicas: int, replica: int) -> Any:
    """This replica's part of a global batch: views, or copies of only its own :class:`Rows`."""
    checked = examine(batch, "split_batch")
    start, stop = replica_range(checked.size, num_replicas, replica)
    return optree.tree_unflatten(checked.treespec, [a[start:stop] for a in checked.leaves])


def empty_batch(spec: Any) -> Any:
    """A batch with no examples, of the structure, dtypes and inner shapes of ``spec``."""
    return nest.tree_map(lambda s: s.empty(), spec)


def fingerprint(
    treespec: Any, leaves: list[Any], shapes: bool = False, memo: Any = None, batched: bool = True
) -> int:
    """A number that differs between nests of different structure or dtypes (or shapes, if asked),
    and between a batch and an unbatched element (``batched``).

    ``leaves`` are arrays or :class:`ArraySpec` (both have ``dtype`` and ``shape``).
    ``memo`` (``Collectives.caches.codes``) remembers it: an iterator computes one at every
    step, and the answer rarely changes.
    """
    key = (
        "batch" if batched else "element",
        treespec,
        shapes,
        tuple((a.dtype, tuple(a.shape) if shapes else None) for a in leaves),
    )

    def text() -> str:
        described = [(np.dtype(a.dtype).str, tuple(a.shape) if shapes else None) for a in leaves]
        return repr((treespec, described) if batched else ("unbatched", treespec, described))

    return cached_code(memo, key, text)


def spec_fingerprint(spec: Any, memo: Any = None) -> int:
    """:func:`fingerprint` of an element spec: structure, dtypes and batched or not, not shapes."""
    leaves, treespec = nest.tree_flatten(spec)
    return fingerprint(treespec, leaves, memo=memo, batched=all(s.batched for s in leaves))


def agree_specs(specs: list[Any], where: str) -> Any:
    """The first rank's spec, after checking every rank's (None: no data) has its structure and dtypes."""
    known = [(r, s) for r, s in enumerate(specs) if s is not None]
    if not known:
        return None
    first_rank, first = known[0]
    for rank, spec in known[1:]:
        if spec_fingerprint(spec) != spec_fingerprint(first):
            raise CollectiveMismatchError(
                f"{where}: the input pipelines yield different elements: rank {first_rank} yields {first}, "
                f"rank {rank} yields {spec}. Every pipeline must yield the same nest structure and dtypes, "
                "and all batches or all unbatched elements"
            )
    return first
