"""What ``update`` and ``update_non_slot`` hand ``fn``: each argument as this replica holds it.

As tf's ``select_replica``: a ``PerReplica`` argument gives this replica's component (each replica
takes its own value), a ``Mirrored`` its value, a variable this rank's copy. Per-replica values
written to a mirrored variable would leave its copies different where they differ, so while the
check is on the ranks compare them first (one handshake, only when a ``PerReplica`` was passed).

>>> from mpistrat.values import Mirrored, PerReplica
>>> select_replica(((PerReplica((1.0, 2.0)), Mirrored((3.0,))), {}), 1, 2, "update").arguments
((2.0, 3.0), {})
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from mpistrat import nest
from mpistrat.collectives import check_enabled
from mpistrat.collectives.fingerprint import checksum, code_of
from mpistrat.comm import packing
from mpistrat.errors import InvalidArgumentError, MpistratError
from mpistrat.values import Mirrored, PerReplica, component, local_variable

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["Selected", "select_replica", "check_per_replica_writes", "ungroup"]

_CONTAINERS = (list, tuple, dict)  # what optree would walk into; anything else is a leaf here


class Selected(NamedTuple):
    """``(args, kwargs)`` as this replica holds them, and the ``PerReplica`` components taken."""

    arguments: tuple[tuple[Any, ...], dict[str, Any]]
    per_replica: list[Any]


def select_replica(
    arguments: tuple[tuple[Any, ...], dict[str, Any]],
    replica: int,
    size: int,
    method: str,
    *,
    one_process: bool = False,
) -> Selected:
    """``arguments`` with each ``PerReplica``, ``Mirrored`` and variable replaced by what ``replica`` holds.

    ``one_process``: inside a root-mode merge_fn, where rank 0 alone writes every rank's copy, a
    ``PerReplica`` of several components cannot be applied (each rank's copy would need its own).
    """
    taken: list[Any] = []

    def one(x: Any) -> Any:
        if isinstance(x, PerReplica):
            if one_process and len(x.values) > 1:
                raise InvalidArgumentError(
                    f"{method}: args and kwargs may not contain per-replica values inside a merge_fn that "
                    "runs on rank 0 alone (it writes every rank's copy alike); reduce them first with "
                    "strategy.extended.reduce_to or batch_reduce_to, or use "
                    "MPIStrategy(merge_call='every_rank')"
                )
            mine = component(x, replica, size, method)
            taken.append(mine)
            return mine
        if isinstance(x, Mirrored):
            return x.values[0]
        return local_variable(x)

    args, kwargs = arguments
    if not kwargs and not any(isinstance(a, _CONTAINERS) for a in args):  # flat (an optimizer's update)
        return Selected((tuple(map(one, args)), kwargs), taken)
    return Selected(nest.tree_map(one, arguments), taken)


def check_per_replica_writes(collectives: Collectives, var: Any, taken: list[Any], method: str) -> None:
    """Before ``fn`` writes ``taken`` (this rank's per-replica values) into a mirrored variable: the same on
    every rank (checksums in one handshake), else ``CollectiveMismatchError`` everywhere, naming the ranks.

    tf writes each replica's copy its own value and lets the copies drift; here they raise instead.
    """
    if not taken or not getattr(var, "mirrored", False) or not check_enabled(collectives):
        return
    code, error = 0, None
    try:
        code = code_of(*(checksum(packing.as_array(v)) for v in taken))
    except MpistratError as exc:
        error = exc
    name = getattr(var, "name", "variable")
    collectives.agree(
        f"{method}({name})",
        fingerprint=code,
        describe=lambda: {
            "leaves": [(repr(name), f"per-replica values with checksum {code:016x}", None)],
            "advice": (
                f"The replicas passed different per-replica values to {method} of the mirrored variable "
                f"{name!r}, which would leave its copies different. Reduce them first "
                "(ReplicaContext.all_reduce, or strategy.extended.reduce_to in a merge_fn), or make the "
                "variable sync-on-read (synchronization=ON_READ) if each replica keeps its own value."
            ),
        },
        error=error,
    )


def ungroup(result: Any) -> Any:
    """``update(group=False)``'s result: each leaf a tuple of the values held here (one replica).

    >>> ungroup({"a": 1})
    {'a': (1,)}
    """
    return nest.tree_map(lambda x: (x,), result)
