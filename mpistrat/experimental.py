"""The names tf keeps under ``tf.distribute.experimental``, for ported code.

>>> import mpistrat
>>> mpistrat.experimental.CommunicationOptions is mpistrat.CommunicationOptions
True
"""

from mpistrat.checkpoint.preemption import PreemptionCheckpointHandler, PreemptionWatcher, TerminationConfig
from mpistrat.distribute.strategy import MultiWorkerMirroredStrategy
from mpistrat.input import ValueContext
from mpistrat.options import CommunicationImplementation, CommunicationOptions

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
