"""The few exception types mpistrat raises.

Each subclasses the built-in that fits, and the one tf.distribute raises in the same place, so
``except ValueError`` (or tf's ``RuntimeError``, ``AssertionError``) keeps working for code ported
from tf.distribute; :class:`MpistratError` catches them all.
"""

from __future__ import annotations

import enum
import pickle
from typing import Any, TypeVar

E = TypeVar("E", bound=enum.Enum)

__all__ = [
    "MpistratError",
    "ContextError",
    "InvalidArgumentError",
    "UnsupportedTypeError",
    "CollectiveMismatchError",
    "StructureMismatchError",
    "CollectiveTimeoutError",
    "CommunicationError",
    "MergeCallError",
    "PEER_FAILED_EXIT",
    "PeerFailedError",
    "portable",
    "enum_member",
]


class MpistratError(Exception):
    """Base class of every error raised by mpistrat."""


class ContextError(MpistratError, RuntimeError):
    """A method was called in the wrong context (replica vs cross-replica)."""


class InvalidArgumentError(MpistratError, ValueError):
    """An argument has the right type but an unusable value."""


class UnsupportedTypeError(MpistratError, TypeError):
    """An argument has a type mpistrat cannot communicate or reduce."""


class CollectiveMismatchError(MpistratError, ValueError, RuntimeError):
    """Ranks entered a collective with incompatible arguments (raised on every rank).

    A ``ValueError``, and a ``RuntimeError`` as tf's where replicas create different variables.
    """


class StructureMismatchError(CollectiveMismatchError, AssertionError):
    """The replicas' nests differ in structure (list or tuple lengths, dict keys): in results of
    ``strategy.run``, arguments of ``merge_call``, or a collective's value. Also an
    ``AssertionError``, as tf.distribute's regrouping of replicas' values asserts."""


class CollectiveTimeoutError(MpistratError, TimeoutError):
    """A collective did not complete within its timeout."""


class CommunicationError(MpistratError, RuntimeError):
    """MPI reported an error in a collective's transfer on this rank (its communicator is left
    mid-operation: the job ends)."""


class MergeCallError(MpistratError, RuntimeError):
    """A ``merge_fn`` raised an exception that could not be re-created on every rank."""


class PeerFailedError(MpistratError, RuntimeError):
    """A rank of the strategy died (or its node was lost): raised by every survivor's pending or next
    collective, instead of a hang.

    ``ranks`` are the ``COMM_WORLD`` ranks known lost when it was raised (possibly empty: MPI reported
    the failure before it could say whose). Where the MPI library can go on without them (ULFM: Open
    MPI launched with ``--with-ft ulfm``), ``strategy.recover()`` rebuilds the strategy on the
    survivors and the loop goes on; elsewhere, or where ``recoverable`` is false (raised by the
    recovery itself: too few ranks left, state lost with them), the job ends with
    :data:`PEER_FAILED_EXIT`.

    >>> error = PeerFailedError("all_reduce: world rank 2 died", ranks=(2,))
    >>> error.ranks, error.recoverable, isinstance(error, RuntimeError)
    ((2,), True, True)
    """

    def __init__(self, message: str, ranks: tuple[int, ...] = (), recoverable: bool = True):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.recoverable = recoverable

    def __reduce__(self) -> Any:
        return type(self), (str(self), self.ranks, self.recoverable)


# The exit status of a job that ends because a rank died (EX_PROTOCOL, 76: after preemption's 75); a
# batch script tells it from other failures and relaunches on the nodes left (jobs/train.sbatch).
PEER_FAILED_EXIT = 76


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling as itself (to be raised on other ranks), else a
    ``MergeCallError`` that says what it was.

    >>> portable(ValueError("bad")).args
    ('bad',)
    """
    try:
        clone = pickle.loads(pickle.dumps(exc))
        if type(clone) is type(exc) and str(clone) == str(exc):
            return exc
    except Exception:
        pass
    return MergeCallError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")


def enum_member(cls: type[E], value: Any, what: str, choices: str | None = None, given: Any = None) -> E:
    """``value`` if it is a member of ``cls``, else the member it names (any case); else an
    ``InvalidArgumentError`` that names ``what`` and the choices. The one way a name becomes an enum.

    >>> class Colour(enum.Enum):
    ...     RED = 1
    >>> enum_member(Colour, "red", "colour")
    <Colour.RED: 1>
    >>> enum_member(Colour, "blue", "colour")
    Traceback (most recent call last):
    mpistrat.errors.InvalidArgumentError: colour must be a Colour or one of RED; got 'blue'
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value.upper() in cls.__members__:
        return cls[value.upper()]
    choices = choices or f"a {cls.__name__} or one of {', '.join(cls.__members__)}"
    raise InvalidArgumentError(f"{what} must be {choices}; got {value if given is None else given!r}")
