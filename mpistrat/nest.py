"""tf.nest-style helpers over optree.

Dicts flatten in sorted key order and ``None`` is a leaf, as in ``tf.nest``.

>>> flatten({"b": [1, 2], "a": 0})
[0, 1, 2]
>>> map_structure(lambda x: x * 10, {"a": 1, "b": (2, 3)})
{'a': 10, 'b': (20, 30)}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

from mpistrat.errors import InvalidArgumentError

__all__ = [
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

_OPTS = {"none_is_leaf": True, "namespace": "mpistrat"}  # the one place mpistrat's tree options live


# optree's functions with mpistrat's options: every tree walk in the package goes through these.


def tree_map(
    fn: Callable[..., Any], tree: Any, *rests: Any, is_leaf: Callable[[Any], bool] | None = None
) -> Any:
    """``optree.tree_map`` with ``None`` a leaf and sorted dict keys."""
    return optree.tree_map(fn, tree, *rests, is_leaf=is_leaf, **_OPTS)  # type: ignore[arg-type]


def tree_flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """``(leaves, treespec)``; ``optree.tree_unflatten(treespec, leaves)`` inverts it."""
    return optree.tree_flatten(tree, **_OPTS)  # type: ignore[arg-type]


def tree_structure(tree: Any) -> optree.PyTreeSpec:
    return optree.tree_structure(tree, **_OPTS)  # type: ignore[arg-type]


def tree_paths(tree: Any) -> list[tuple[Any, ...]]:
    return optree.tree_paths(tree, **_OPTS)  # type: ignore[arg-type]


def flatten(structure: Any) -> list[Any]:
    """The leaves of ``structure`` in tf.nest order."""
    return optree.tree_leaves(structure, **_OPTS)


def flatten_with_paths(structure: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``(path, leaf)`` pairs, where ``path`` is the tuple of keys leading to the leaf.

    >>> flatten_with_paths({"a": [5, 6]})
    [(('a', 0), 5), (('a', 1), 6)]
    """
    paths, leaves, _ = optree.tree_flatten_with_path(structure, **_OPTS)
    return list(zip(paths, leaves, strict=True))


def path_str(path: tuple[Any, ...]) -> str:
    """A key path written as indexing, e.g. ``['a'][0]``; the root is ``<root>``."""
    return "".join(f"[{key!r}]" for key in path) or "<root>"


def pack_sequence_as(structure: Any, flat_sequence: list[Any]) -> Any:
    """Rebuild ``structure`` with its leaves replaced by ``flat_sequence``."""
    treespec = optree.tree_structure(structure, **_OPTS)
    flat = list(flat_sequence)
    if len(flat) != treespec.num_leaves:
        raise InvalidArgumentError(
            f"pack_sequence_as: the structure has {treespec.num_leaves} leaves "
            f"but flat_sequence has {len(flat)}"
        )
    return optree.tree_unflatten(treespec, flat)


def map_structure(func: Callable[..., Any], *structures: Any) -> Any:
    """Apply ``func`` to corresponding leaves of structures that have the same shape."""
    if not structures:
        raise InvalidArgumentError("map_structure needs at least one structure")
    for other in structures[1:]:
        assert_same_structure(structures[0], other)
    return optree.tree_map(func, *structures, **_OPTS)


def assert_same_structure(nest1: Any, nest2: Any) -> None:
    """Raise ``ValueError`` naming the first differing key path if the nests differ."""
    spec1 = optree.tree_structure(nest1, **_OPTS)
    spec2 = optree.tree_structure(nest2, **_OPTS)
    if spec1 == spec2:
        return
    paths1 = [p for p, _ in flatten_with_paths(nest1)]
    paths2 = [p for p, _ in flatten_with_paths(nest2)]
    for p1, p2 in zip(paths1, paths2, strict=False):
        if p1 != p2:
            where = f"first difference at {path_str(p1)} vs {path_str(p2)}"
            break
    else:
        longer, name = (paths1, "first") if len(paths1) > len(paths2) else (paths2, "second")
        extra = path_str(longer[min(len(paths1), len(paths2))])
        where = f"{len(paths1)} leaves vs {len(paths2)} leaves; {extra} is only in the {name}"
    raise InvalidArgumentError(
        f"The two structures don't have the same nested structure ({where}).\n"
        f"First structure: {spec1}\nSecond structure: {spec2}"
    )


def is_nested(structure: Any) -> bool:
    """True for a list, tuple, dict or namedtuple (anything that is not a leaf)."""
    return not optree.treespec_is_leaf(optree.tree_structure(structure, **_OPTS))
