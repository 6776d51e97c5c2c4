"""tf.nest-style helpers over optree.

Dicts flatten in sorted key order and ``None`` is a leaf, as in ``tf.nest``. An
``OrderedDict`` flattens in insertion order (optree's rule; tf.nest sorts its keys too).
optree is imported at the first walk of a nest: a job whose values are single arrays and
numbers (:data:`LEAF_TYPES`, mapped without a walk) never reads its files.

>>> flatten({"b": [1, 2], "a": 0})
[0, 1, 2]
>>> map_structure(lambda x: x * 10, {"a": 1, "b": (2, 3)})
{'a': 10, 'b': (20, 30)}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from mpistrat.errors import InvalidArgumentError, MpistratError, UnsupportedTypeError

if TYPE_CHECKING:
    import optree

__all__ = [
    "LEAF_TYPES",
    "tree_flatten",
    "tree_map",
    "tree_paths",
    "tree_structure",
    "flatten",
    "flatten_with_paths",
    "pack_sequence_as",
    "map_structure",
    "assert_same_structure",
    "is_nested",
    "path_str",
]


class _TreeOptions(TypedDict):
    none_is_leaf: bool
    namespace: str


# The one place mpistrat's tree options live.
_OPTS: _TreeOptions = {"none_is_leaf": True, "namespace": "mpistrat"}

# Types that are always one leaf under these options (an array, a number, None): mapped without
# optree (a gradient, a metric, a strategy.run result).
LEAF_TYPES = frozenset({np.ndarray, type(None), bool, int, float, np.float32, np.float64, np.int32, np.int64})


# optree's functions with mpistrat's options: every tree walk in the package goes through these.


def tree_map(
    fn: Callable[..., Any], tree: Any, *rests: Any, is_leaf: Callable[[Any], bool] | None = None
) -> Any:
    """``optree.tree_map`` with ``None`` a leaf and sorted dict keys.

    >>> tree_map(lambda x, y: (x, y), 1, [2, 3])  # a leaf is a prefix of any tree: y is whole
    (1, [2, 3])
    """
    if type(tree) in LEAF_TYPES:
        return fn(tree, *rests)
    import optree

    return optree.tree_map(fn, tree, *rests, is_leaf=is_leaf, **_OPTS)


def tree_flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """``(leaves, treespec)``; ``optree.tree_unflatten(treespec, leaves)`` inverts it."""
    import optree

    return optree.tree_flatten(tree, **_OPTS)


def tree_structure(tree: Any) -> optree.PyTreeSpec:
    import optree

    return optree.tree_structure(tree, **_OPTS)


def tree_paths(tree: Any) -> list[tuple[Any, ...]]:
    import optree

    return optree.tree_paths(tree, **_OPTS)


def flatten(structure: Any) -> list[Any]:
    """The leaves of ``structure`` in tf.nest order."""
    import optree

    return optree.tree_leaves(structure, **_OPTS)


def flatten_with_paths(structure: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``(path, leaf)`` pairs, where ``path`` is the tuple of keys leading to the leaf.

    >>> flatten_with_paths({"a": [5, 6]})
    [(('a', 0), 5), (('a', 1), 6)]
    """
    import optree

    paths, leaves, _ = optree.tree_flatten_with_path(structure, **_OPTS)
    return list(zip(paths, leaves, strict=True))


def path_str(path: tuple[Any, ...]) -> str:
    """A key path written as indexing, e.g. ``['a'][0]``; the root is ``<root>``."""
    return "".join(f"[{key!r}]" for key in path) or "<root>"


def pack_sequence_as(structure: Any, flat_sequence: list[Any]) -> Any:
    """Rebuild ``structure`` with its leaves replaced by ``flat_sequence``."""
    import optree

    treespec = optree.tree_structure(structure, **_OPTS)
    flat = list(flat_sequence)
    if len(flat) != treespec.num_leaves:
        raise InvalidArgumentError(
            f"pack_sequence_as: the structure has {treespec.num_leaves} leaves "
            f"but flat_sequence has {len(flat)}"
        )
    return optree.tree_unflatten(treespec, flat)


def map_structure(func: Callable[..., Any], *structures: Any, check_types: bool = True) -> Any:
    """Apply ``func`` to corresponding leaves of structures that have the same shape.

    The result has the first structure's shape; ``check_types`` as in :func:`assert_same_structure`.
    """
    if not structures:
        raise InvalidArgumentError("map_structure needs at least one structure")
    for other in structures[1:]:
        assert_same_structure(structures[0], other, check_types=check_types)
    import optree

    # Leaves pair up in tf.nest's order, every mapping by sorted key: a dict and an OrderedDict
    # with the same keys pair by key although optree flattens the OrderedDict as inserted.
    paths, first, spec = optree.tree_flatten_with_path(structures[0], **_OPTS)
    order = sorted(range(len(paths)), key=paths.__getitem__)
    others = [_in_tf_order(s) for s in structures[1:]]
    out: list[Any] = [None] * len(first)
    for k, i in enumerate(order):
        out[i] = func(first[i], *(o[k] for o in others))
    return optree.tree_unflatten(spec, out)


def _by_key(entries: list[Any], children: list[Any]) -> tuple[list[Any], list[Any]]:
    pairs = sorted(zip(entries, children, strict=True), key=lambda pair: pair[0])
    return [e for e, _ in pairs], [c for _, c in pairs]


def _in_tf_order(structure: Any) -> list[Any]:
    """The leaves in tf.nest's order: depth first, every mapping's entries by sorted key (the
    lexicographic order of their key paths)."""
    import optree

    paths, leaves, _ = optree.tree_flatten_with_path(structure, **_OPTS)
    return [leaves[i] for i in sorted(range(len(paths)), key=paths.__getitem__)]


def assert_same_structure(nest1: Any, nest2: Any, check_types: bool = True) -> None:
    """Raise if the nests differ, naming the first differing key path, as ``tf.nest`` does.

    A different container type (a list for a tuple, a namedtuple for a tuple) raises
    ``TypeError`` when ``check_types`` (mappings count as one type); a different number
    of elements, different dict keys or a leaf for a container raises ``ValueError``.
    Without ``check_types`` only the number of leaves under each container counts.

    >>> assert_same_structure([1, 2], (3, 4), check_types=False)
    """
    spec1, spec2 = tree_structure(nest1), tree_structure(nest2)
    if spec1 == spec2:
        return
    found = _first_difference(spec1, spec2, (), check_types)
    if found is None:
        return
    error, where = found
    raise error(
        f"The two structures don't have the same nested structure ({where}).\n"
        f"First structure: {spec1}\nSecond structure: {spec2}"
    )


def _first_difference(
    spec1: optree.PyTreeSpec, spec2: optree.PyTreeSpec, path: tuple[Any, ...], check_types: bool
) -> tuple[type[Exception], str] | None:
    leaf1, leaf2 = spec1.is_leaf(), spec2.is_leaf()
    if leaf1 or leaf2:
        if leaf1 and leaf2:
            return None
        kinds = [
            ("a leaf" if leaf else f"a {_node_type(s).__name__}")
            for leaf, s in ((leaf1, spec1), (leaf2, spec2))
        ]
        return InvalidArgumentError, f"at {path_str(path)}: {kinds[0]} vs {kinds[1]}"
    type1, type2 = _node_type(spec1), _node_type(spec2)
    mappings = issubclass(type1, Mapping) and issubclass(type2, Mapping)
    if check_types and type1 is not type2 and not mappings:
        return UnsupportedTypeError, f"at {path_str(path)}: a {type1.__name__} vs a {type2.__name__}"
    entries1, entries2 = spec1.entries(), spec2.entries()
    if len(entries1) != len(entries2):
        return InvalidArgumentError, f"at {path_str(path)}: {len(entries1)} vs {len(entries2)} elements"
    children1, children2 = spec1.children(), spec2.children()
    if mappings:  # tf.nest sorts every mapping's keys; optree keeps an OrderedDict's insertion order
        if check_types and set(entries1) != set(entries2):
            return InvalidArgumentError, f"at {path_str(path)}: keys {sorted(entries1)} vs {sorted(entries2)}"
        entries1, children1 = _by_key(entries1, children1)
        entries2, children2 = _by_key(entries2, children2)
    for entry, child1, child2 in zip(entries1, children1, children2, strict=True):
        found = _first_difference(child1, child2, (*path, entry), check_types)
        if found is not None:
            return found
    return None


def _node_type(spec: optree.PyTreeSpec) -> type:
    """The container type at the root of a non-leaf ``spec`` (optree types only leaves as ``None``)."""
    node_type = spec.type
    if node_type is None:
        raise MpistratError(f"a tree node without a container type: {spec}")
    return node_type


def is_nested(structure: Any) -> bool:
    """True for a list, tuple, dict or namedtuple (anything that is not a leaf)."""
    import optree

    return not optree.treespec_is_leaf(optree.tree_structure(structure, **_OPTS))
