"""The public names of mpistrat, for type checkers and for ``__init__.py``, which imports each
on first use (PEP 562): a new public name is a line here (its import and its ``__all__`` entry).

A name is looked for in the module of its ``from ... import`` line; a module imported from a
package (``from mpistrat.training import metrics``) is imported as a submodule.
"""

from mpi4py import MPI

from mpistrat import experimental, nest
from mpistrat.checkpoint.checkpoint import Checkpoint, CheckpointLoadStatus, latest_checkpoint
from mpistrat.checkpoint.manager import CheckpointManager
from mpistrat.checkpoint.preemption import PreemptionCheckpointHandler, PreemptionWatcher, TerminationConfig
from mpistrat.diagnostics.abort import set_abort_on_exception
from mpistrat.diagnostics.stragglers import StragglerRow, Stragglers
from mpistrat.diagnostics.timeline import start_timeline, stop_timeline, trace
from mpistrat.distribute import cluster_resolver
from mpistrat.distribute.current import get_cross_replica_context, get_replica_context, get_strategy
from mpistrat.distribute.extended import StrategyExtended
from mpistrat.distribute.replica_context import ReplicaContext
from mpistrat.distribute.strategy import MPIStrategy, MultiWorkerMirroredStrategy, Strategy
from mpistrat.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicationError,
    ContextError,
    InvalidArgumentError,
    MergeCallError,
    MpistratError,
    PeerFailedError,
    StructureMismatchError,
    UnsupportedTypeError,
)
from mpistrat.input.arrays import ArrayDataset
from mpistrat.input.batches import ArraySpec
from mpistrat.input.contexts import InputContext, InputOptions, InputReplicationMode, ValueContext
from mpistrat.input.datasets import DistributedDataset, DistributedDatasetsFromFunction, InputIterator
from mpistrat.input.iterators import DistributedIterator
from mpistrat.interface.modes import experimental_set_strategy, has_strategy, in_cross_replica_context
from mpistrat.options import CheckpointOptions, CommunicationImplementation, CommunicationOptions
from mpistrat.reduce_op import ReduceOp
from mpistrat.training import metrics, optimizers
from mpistrat.training.distributed_variables import MirroredVariable, SyncOnReadVariable
from mpistrat.training.losses import compute_average_loss, scale_regularization_loss
from mpistrat.training.variables import Variable, VariableAggregation, VariableSynchronization
from mpistrat.values import DistributedValues, Mirrored, PerReplica

__version__: str

__all__ = [
    "MPI",
    "ArrayDataset",
    "ArraySpec",
    "Checkpoint",
    "CheckpointLoadStatus",
    "CheckpointManager",
    "CheckpointOptions",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommunicationError",
    "CommunicationImplementation",
    "CommunicationOptions",
    "ContextError",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "DistributedValues",
    "InputContext",
    "InputIterator",
    "InputOptions",
    "InputReplicationMode",
    "InvalidArgumentError",
    "MPIStrategy",
    "MergeCallError",
    "Mirrored",
    "MirroredVariable",
    "MpistratError",
    "MultiWorkerMirroredStrategy",
    "PeerFailedError",
    "PerReplica",
    "PreemptionCheckpointHandler",
    "PreemptionWatcher",
    "ReduceOp",
    "ReplicaContext",
    "Strategy",
    "StrategyExtended",
    "StragglerRow",
    "Stragglers",
    "StructureMismatchError",
    "SyncOnReadVariable",
    "TerminationConfig",
    "UnsupportedTypeError",
    "ValueContext",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "cluster_resolver",
    "compute_average_loss",
    "experimental",
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "latest_checkpoint",
    "metrics",
    "nest",
    "optimizers",
    "scale_regularization_loss",
    "set_abort_on_exception",
    "start_timeline",
    "stop_timeline",
    "trace",
]
