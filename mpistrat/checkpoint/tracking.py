"""What a ``Checkpoint`` tracks under one keyword, and the names of the entries.

A value may be a variable, an optimizer, a distributed dataset or iterator (its position), a
dict/list/tuple nest of them, or any object holding them as public attributes, as a model
class does (``self.dense = Dense(...)`` with ``self.kernel = Variable(...)`` inside): objects are
walked attribute by attribute, in name order, as tf's ``Checkpoint`` tracks a ``tf.Module``'s.
An object with no public attribute to track is tracked by its ``trainable_variables`` or
``variables`` (a list), as a Keras model exposes them. Names are the key paths,
``model/dense/kernel``; something reached twice (a shared layer, a list of the layers, a
reference back to the model) is tracked once, under its shortest name. As tf's checkpoints
name objects, a ``.`` in a key is written ``..`` and a ``/`` is written ``.S``, so two paths
never share a name: ``{"dense/kernel": k1, "dense": {"kernel": k2}}`` under ``model`` holds
``model/dense.Skernel`` and ``model/dense/kernel``.

>>> import numpy as np
>>> from mpistrat.training.variables import Variable
>>> class Dense:
...     def __init__(self):
...         self.kernel, self.bias = Variable(np.ones((2, 3))), Variable(np.zeros(3))
>>> class Model:
...     def __init__(self):
...         self.hidden, self.out = Dense(), Dense()
...         self.out.first = self.hidden  # a second path to the same layer
>>> sorted(name for name, _ in tracked("model", Model()))
['model/hidden/bias', 'model/hidden/kernel', 'model/out/bias', 'model/out/kernel']
"""

from __future__ import annotations

import collections
import inspect
import types
from typing import Any

import numpy as np

from mpistrat import nest
from mpistrat.errors import InvalidArgumentError
from mpistrat.input.datasets import input_position
from mpistrat.training.optimizers import LossScaleOptimizer, Optimizer
from mpistrat.training.variables import Variable

__all__ = ["escaped", "name_before_escaping", "tracked"]

_DEPTH = 64  # nests and objects deeper than this are a mistake (or a structure that never ends)
_EXPECTED = (
    "a Variable, an optimizer, a distributed dataset or iterator, a nest of them, or an object holding them"
)


def tracked(key: str, value: Any) -> list[tuple[str, Any]]:
    """``(name, leaf)`` for everything ``value`` holds: leaves are variables, optimizers and
    ``InputPosition`` entries, each named by its shortest path (then in attribute order, as
    tf names a checkpoint's objects). An error names what cannot be tracked: a leaf of a nest
    given to the checkpoint, or an object holding nothing; inside an object, whatever holds
    nothing to track (a number, a function, a configuration object) is passed over."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()
    queue = collections.deque([(escaped(key), value, 0, True)])
    while queue:
        name, item, depth, strict = queue.popleft()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if depth > _DEPTH:
            raise InvalidArgumentError(f"Checkpoint: {name} is nested more than {_DEPTH} levels deep")
        if isinstance(item, (Variable, Optimizer, LossScaleOptimizer)):
            out.append((name, item))
        elif (position := input_position(item)) is not None:
            out.append((name, position))
        elif isinstance(item, (dict, list, tuple)):
            for path, leaf in nest.flatten_with_paths(item):
                queue.append(("/".join([name, *(escaped(str(k)) for k in path)]), leaf, depth + 1, strict))
        else:
            attributes = _attributes(item) if _may_hold(item) else []
            if not attributes and strict and depth > 0:
                raise InvalidArgumentError(
                    f"Checkpoint: {name} must be {_EXPECTED}; got {type(item).__name__}"
                )
            queue.extend((f"{name}/{escaped(a)}", child, depth + 1, False) for a, child in attributes)
    if not out and not isinstance(value, (dict, list, tuple)):
        raise InvalidArgumentError(
            f"Checkpoint: {key} ({type(value).__name__}) holds nothing to track; expected {_EXPECTED}"
        )
    return out


def escaped(key: str) -> str:
    """``key`` as one part of an entry's name, as tf escapes it: ``.`` as ``..``, ``/`` as ``.S``.

    >>> escaped("dense/kernel"), escaped("head.b")
    ('dense.Skernel', 'head..b')
    """
    return key.replace(".", "..").replace("/", ".S")


def name_before_escaping(name: str) -> str:
    """The name of an entry in a file of an earlier version, which wrote keys as they are, in this
    version's words: its dots doubled (a ``/`` was the separator, or a key's: it stays one).

    >>> name_before_escaping("model/head.b")
    'model/head..b'
    """
    return name.replace(".", "..")


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    """The public attributes of ``obj`` that may hold something to track, in name order; else its
    ``trainable_variables`` or ``variables`` list."""
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        found = sorted(
            ((k, v) for k, v in state.items() if not k.startswith("_") and _may_hold(v)), key=_first
        )
        if found:
            return found
    for listed in ("trainable_variables", "variables"):
        values = getattr(obj, listed, None)
        if isinstance(values, (list, tuple)) and values and all(isinstance(v, Variable) for v in values):
            return [(listed, list(values))]
    return []


def _first(pair: tuple[str, Any]) -> str:
    return pair[0]


def _may_hold(value: Any) -> bool:
    """Whether an attribute's value could hold a variable: not a number, a string, an array, a
    function, a class or a module."""
    plain = (type(None), bool, int, float, complex, str, bytes, type, types.ModuleType, np.ufunc)
    if isinstance(value, plain) or inspect.isroutine(value):
        return False
    return not hasattr(value, "__array_interface__") and not hasattr(value, "__cuda_array_interface__")
