"""``strategy.run``'s closing handshake: every replica's result has a structure tf could regroup.

tf.distribute regroups the replicas' results into ``PerReplica`` values and asserts where their
structures differ (a list whose length depends on the replica, other dict keys): replica 0's
result is the reference, and wherever it holds a list, tuple or mapping every other replica must
hold one of the same length or keys. Here each rank keeps its own result, so the ranks compare
a code of its structure in one handshake (a fixed number of bytes at any number of ranks); only
when the codes differ do they exchange the structures to apply tf's rule exactly. An exception in
``fn`` rides in the same handshake, so every rank raises instead of waiting for the one that failed.

>>> form([1.0, {"b": None, "a": (2, 3)}])
('list', (None, ('dict', (('a', ('tuple', (None, None))), ('b', None)))))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpistrat import nest
from mpistrat.collectives import leaves
from mpistrat.collectives.closing import close_step
from mpistrat.collectives.fingerprint import cached_code
from mpistrat.errors import CollectiveMismatchError, StructureMismatchError

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives
    from mpistrat.collectives.caches import Caches

__all__ = ["agree_on_result", "fits", "form"]

KIND = "strategy.run (result)"
# By the names of optree's PyTreeKind (a result that is one array never imports optree).
_SEQUENCES = {
    "LIST": "list",
    "TUPLE": "tuple",
    "NAMEDTUPLE": "tuple",  # tf's regroup takes a namedtuple for a tuple
    "STRUCTSEQUENCE": "tuple",
}
_MAPPINGS = ("DICT", "ORDEREDDICT", "DEFAULTDICT")


def agree_on_result(collectives: Collectives, result: Any, error: Exception | None) -> None:
    """Raise on every rank if some rank's ``fn`` raised (``error``, this rank's own) or if the results'
    structures could not be regrouped (``StructureMismatchError``, an ``AssertionError`` as tf's)."""
    if not collectives.check:
        if error is not None:
            raise error
        return
    spec = None

    def code() -> int:  # the result's structure, found only when the closing sends
        nonlocal spec
        if error is not None:
            return 0
        spec, fingerprint = _structure(collectives.caches, result)
        return fingerprint

    told = error
    if isinstance(error, StructureMismatchError):  # the others must not take it for their results' mismatch
        told = CollectiveMismatchError(str(error))
    try:
        close_step(collectives, KIND, code, lambda: _describe(spec), told)
    except StructureMismatchError as exc:  # no rank raised: only the results' structures differ
        _regroup_or_raise(collectives, spec, exc)
        return
    except BaseException:
        if error is None:
            raise
    if error is not None:
        raise error  # this rank's own exception, as it was raised (outside the handler: its context kept)


def _regroup_or_raise(collectives: Collectives, spec: Any, exc: StructureMismatchError) -> None:
    """The results' structures differ (the handshake said so, on every rank): raise ``exc`` unless
    tf would regroup them (replica 0 holds a leaf where another holds a nest)."""
    forms = collectives.comm.allgather(_form(spec))  # every rank is here: the handshake said so
    if not all(fits(forms[0], f) for f in forms[1:]):
        raise exc from None


def _structure(caches: Caches, result: Any) -> tuple[Any, int]:
    """The result's structure as the collectives flatten nests, and its code. A loop returns the same
    structure every step: the last one is kept where a cheap look tells it again (one leaf; a list
    or tuple of as many leaves)."""
    kind = type(result)
    last = caches.last_result  # (type, length or None for a leaf, spec, code)
    if (
        last is not None
        and last[0] is kind
        and (last[1] is None or (len(result) == last[1] and leaves.all_leaves(result)))
    ):
        return last[2], last[3]
    spec = leaves.flatten(result, caches.flat)[1]
    code = cached_code(caches.codes, (KIND, spec), lambda: repr(_form(spec)))
    if spec is leaves.LEAF_SPEC:
        caches.last_result = (kind, None, spec, code)
    elif (kind is list or kind is tuple) and leaves.all_leaves(result):
        caches.last_result = (kind, len(result), spec, code)
    return spec, code


def form(value: Any) -> Any:
    """The structure tf's regroup compares: ``None`` for a leaf, ``(kind, children)`` for a list or
    tuple, ``("dict", ((key, child), ...))`` for a mapping (keys sorted)."""
    return _form(nest.tree_structure(value))


def _form(spec: Any) -> Any:
    if spec is leaves.LEAF_SPEC or spec.is_leaf():
        return None
    children = tuple(_form(c) for c in spec.children())
    kind = spec.kind.name
    if kind in _SEQUENCES:
        return (_SEQUENCES[kind], children)
    if kind in _MAPPINGS:
        return ("dict", tuple(sorted(zip(spec.entries(), children, strict=True), key=lambda kc: repr(kc[0]))))
    return (spec.type.__qualname__, children)


def fits(reference: Any, other: Any) -> bool:
    """Whether tf's regroup takes ``other`` beside ``reference`` (replica 0's): the same containers,
    lengths and keys wherever ``reference`` has a container.

    >>> fits(None, ("list", (None,))), fits(("list", (None,)), ("list", (None, None)))
    (True, False)
    """
    if reference is None:
        return True
    if other is None or reference[0] != other[0] or len(reference[1]) != len(other[1]):
        return False
    if reference[0] == "dict":
        return all(k == ok and fits(c, oc) for (k, c), (ok, oc) in zip(reference[1], other[1], strict=True))
    return all(fits(c, oc) for c, oc in zip(reference[1], other[1], strict=True))


def _describe(spec: Any) -> dict[str, Any]:
    text = "(raised)" if spec is None else _text(_form(spec))
    return {
        "leaves": [("strategy.run's result", f"structured {text}", None)],
        "structure": text,
        "advice": (
            "Every replica's fn must return the same nest structure (list and tuple lengths, dict "
            "keys), as tf.distribute regroups the replicas' results."
        ),
    }


def _text(f: Any) -> str:
    """A short picture of a form: ``*`` a leaf, ``[..]`` a list, ``(..)`` a tuple, ``{k: ..}`` a mapping."""
    if f is None:
        return "*"
    kind, children = f
    if kind == "dict":
        return "{" + ", ".join(f"{k!r}: {_text(c)}" for k, c in children) + "}"
    inner = ", ".join(_text(c) for c in children)
    return {"list": f"[{inner}]", "tuple": f"({inner})"}.get(kind, f"{kind}({inner})")
