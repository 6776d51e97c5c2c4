"""The names tf keeps under ``tf.distribute.experimental``, for ported code.

>>> import mpistrat
>>> mpistrat.experimental.CommunicationOptions is mpistrat.CommunicationOptions
True
"""

from typing import TYPE_CHECKING, Any

from mpistrat.distribute.strategy import MultiWorkerMirroredStrategy
from mpistrat.input.contexts import ValueContext
from mpistrat.options import CommunicationImplementation, CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.checkpoint.preemption import (
        PreemptionCheckpointHandler,
        PreemptionWatcher,
        TerminationConfig,
    )

# tf's older name for CommunicationImplementation
CollectiveCommunication = CommunicationImplementation

__all__ = [
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "PreemptionCheckpointHandler",
    "PreemptionWatcher",
    "TerminationConfig",
    "ValueContext",
]

# The preemption names bring the checkpoint package, which a job that never saves does not need:
# they are imported on first use (PEP 562), as mpistrat's own public names are.
_PREEMPTION = ("PreemptionCheckpointHandler", "PreemptionWatcher", "TerminationConfig")


def __getattr__(name: str) -> Any:
    if name not in _PREEMPTION:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from mpistrat.checkpoint import preemption

    value = globals()[name] = getattr(preemption, name)
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
