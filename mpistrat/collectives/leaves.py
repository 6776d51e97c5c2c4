"""From a nest to arrays, and the cached fingerprints and pack plans of repeated calls.

What every array collective does before it communicates: flatten the nest (fast for
the flat lists and dicts of arrays a training loop passes), turn leaves into arrays
with an error naming the leaf, and compute the fingerprint the handshake compares and
the plan that packs leaves into buffers. A training loop repeats the same calls every
step, so both are cached by structure, dtypes and shapes.

>>> import numpy as np
>>> flatten({"b": np.ones(2), "a": np.zeros(1)})[0]
[array([0.]), array([1., 1.])]
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat import nest
from mpistrat.collectives.fingerprint import arrays_code
from mpistrat.comm import packing
from mpistrat.errors import InvalidArgumentError, MpistratError
from mpistrat.options import CommunicationOptions
from mpistrat.reduce_op import ReduceOp
from mpistrat.values import HasLocalCopy, local_copy

if TYPE_CHECKING:
    from mpistrat.collectives.caches import Caches

__all__ = [
    "LEAF_SPEC",
    "all_leaves",
    "device_implementation",
    "divide",
    "flatten",
    "known_reduce_op",
    "leaf_path",
    "like_leaves",
    "moveaxis_to_front",
    "numpy_plan",
    "plain",
    "reduce_op",
    "to_arrays",
    "too_deep",
    "unflatten",
]


def like_leaves(leaves: list[Any], out: list[Any]) -> list[Any]:
    """Results for number leaves as NumPy scalars (0-d arrays otherwise, variables included)."""
    return [
        o if isinstance(x, (np.ndarray, HasLocalCopy)) or packing.array_module(x) is not np else o[()]
        for x, o in zip(leaves, out, strict=True)
    ]


def moveaxis_to_front(arr: Any, axis: int) -> Any:
    return arr if axis == 0 else packing.array_module(arr).moveaxis(arr, axis, 0)


def leaf_path(value: Any, index: int) -> str:
    return nest.path_str(nest.flatten_with_paths(value)[index][0])


def to_arrays(value: Any, leaves: list[Any], kind: str) -> list[Any]:
    """The leaves as arrays (a variable: its local copy); on bad input, an error naming the leaf."""
    try:
        return packing.as_arrays(leaves)
    except MpistratError:
        for path, leaf in nest.flatten_with_paths(value):
            packing.as_array(local_copy(leaf), f"{kind}: leaf {nest.path_str(path)}")
        if any(isinstance(leaf, HasLocalCopy) for leaf in leaves):  # read as tf reads them: no copy
            return packing.as_arrays([local_copy(leaf) for leaf in leaves])
        raise


_REDUCE_OPS: dict[Any, ReduceOp] = {}
_DTYPE_SHAPE = operator.attrgetter("dtype", "shape")


class _OneLeaf:
    """The structure :func:`flatten` gives a value that is one leaf, whatever its type: its own
    object, so that one array's collective, fingerprint and result need no optree."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "*"


LEAF_SPEC = _OneLeaf()


def plain(dtype: np.dtype) -> bool:
    """A numeric dtype in the machine's byte order (what the one-array fast path takes)."""
    return dtype.kind in "iufc" and dtype.isnative


def all_leaves(values: Any) -> bool:
    """Whether every item of ``values`` is of a type that is always one leaf (an array, a number, None).

    >>> all_leaves([np.ones(2), 1.0, None]), all_leaves([np.ones(2), [1.0]])
    (True, False)
    """
    return nest.LEAF_TYPES.issuperset(map(type, values))


def known_reduce_op(value: Any) -> ReduceOp | None:
    """The ReduceOp for a name or member already seen, else None."""
    try:
        return _REDUCE_OPS.get(value)
    except TypeError:
        return None


def reduce_op(value: ReduceOp | str) -> ReduceOp:
    """``ReduceOp.from_any``, remembered for the (few) valid names and members."""
    op = known_reduce_op(value)
    if op is None:
        op = ReduceOp.from_any(value)
        if isinstance(value, (str, ReduceOp)):
            _REDUCE_OPS[value] = op
    return op


def numpy_plan(
    caches: Caches, op: ReduceOp | None, treespec: Any, arrays: list[Any], bytes_per_pack: int
) -> tuple[int, list[packing.Pack]]:
    """(fingerprint, pack plan) for plain NumPy ``arrays`` (the fingerprint: :func:`.arrays_code`).

    The last plan per structure is kept: comparing a signature costs less than hashing it.
    """
    sig = tuple(map(_DTYPE_SHAPE, arrays))
    last = caches.plans.get(treespec)
    if last is not None and last[0] is op and last[1] == bytes_per_pack and last[2] == sig:
        return last[3], last[4]
    code = arrays_code(caches.codes, op, None, treespec, arrays, sig, bytes_per_pack)
    packs = packing.plan_packs(arrays, bytes_per_pack, sig, caches.packs)
    caches.plans.keep(treespec, (op, bytes_per_pack, sig, code, packs))
    return code, packs


def flatten(value: Any, memo: Any = None) -> tuple[list[Any], Any]:
    """``nest.tree_flatten(value)`` with mpistrat's options, faster for flat containers of arrays;
    :func:`unflatten` inverts it.

    Flat lists, tuples and dicts of NumPy arrays (gradients, metrics) are flattened from the
    structures ``memo`` (``Collectives.caches.flat``) remembers: optree spends ~0.2 us per
    leaf deciding that an array is a leaf. A value that is one leaf has the structure
    :data:`LEAF_SPEC` (an array, a number or None without a walk).
    """
    kind = type(value)
    if kind in nest.LEAF_TYPES:
        return [value], LEAF_SPEC
    flat = kind is list or kind is tuple or kind is dict
    flat = flat and memo is not None
    if flat:
        key = (kind, tuple(value) if kind is dict else len(value))
        known = memo.get(key)
        if known is not None:
            spec, order = known
            leaves = list(map(value.__getitem__, order)) if order is not None else list(value)
            if packing.all_numpy(leaves):
                return leaves, spec
    try:
        leaves, spec = nest.tree_flatten(value)
    except RecursionError as exc:  # raised on this rank alone: it must travel through the handshake
        raise too_deep() from exc
    if spec.is_leaf():  # another type of leaf (a variable, a float16): the same structure
        return leaves, LEAF_SPEC
    children = list(value.values()) if kind is dict else value
    if flat and packing.all_numpy(children) and len(leaves) == len(value):  # each child is a leaf
        order = None
        if kind is dict:  # the keys in optree's leaf order
            order = tuple(path[0] for path in nest.tree_paths(value))
        memo.keep(key, (spec, order))
    return leaves, spec


def unflatten(spec: Any, leaves: list[Any]) -> Any:
    """The nest of structure ``spec`` (:func:`flatten`'s) holding ``leaves``.

    >>> unflatten(flatten(np.ones(2))[1], [3.0]), unflatten(flatten((1, [2]))[1], [3, 4])
    (3.0, (3, [4]))
    """
    if spec is LEAF_SPEC:
        return leaves[0]
    import optree  # loaded already: it made ``spec``

    return optree.tree_unflatten(spec, leaves)


def too_deep() -> InvalidArgumentError:
    """The error for a nest deeper than optree (and Python) will walk."""
    import optree  # loaded already: its walk raised

    # optree refuses to walk deeper than this (a RecursionError), whatever sys.getrecursionlimit() says.
    depth = getattr(optree, "MAX_RECURSION_DEPTH", 1000)
    return InvalidArgumentError(
        f"the nest is too deep: more than about {depth} levels of containers "
        "(optree's and Python's recursion limit); pass a flatter nest"
    )


def divide(x: Any, n: int) -> Any:
    """True division (ints become float64, as ``tf.distribute`` MEAN of ints gives 49.5)."""
    xp = packing.array_module(x)
    if x.dtype.kind in "fc":
        xp.true_divide(x, n, out=x)
        return x
    return xp.true_divide(x, n)


def device_implementation(arrays: list[Any], opts: CommunicationOptions) -> str | None:
    """The implementation option when it matters (device arrays present): ranks must agree on it."""
    return opts.implementation.value if any(packing.is_device_array(a) for a in arrays) else None
