"""mpistrat: the tf.distribute programming model on MPI, for NumPy and CuPy arrays.

>>> import mpistrat, numpy as np
>>> strategy = mpistrat.MPIStrategy()
>>> def step(x):
...     ctx = mpistrat.get_replica_context()
...     return ctx.all_reduce("sum", x)
>>> total = strategy.run(step, args=(np.ones(3),))
"""

from mpi4py import MPI

from mpistrat import (
    cluster_resolver,
    experimental,
    metrics,
    nest,
    optimizers,
)
from mpistrat.abort import set_abort_on_exception
from mpistrat.checkpoint import Checkpoint, CheckpointLoadStatus, latest_checkpoint
from mpistrat.checkpoint_manager import CheckpointManager
from mpistrat.context import (
    experimental_set_strategy,
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from mpistrat.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ContextError,
    InvalidArgumentError,
    MergeCallError,
    MpistratError,
    UnsupportedTypeError,
)
from mpistrat.extended import StrategyExtended
from mpistrat.input import (
    ArrayDataset,
    ArraySpec,
    DistributedDataset,
    DistributedDatasetsFromFunction,
    DistributedIterator,
    InputContext,
    InputIterator,
    InputOptions,
    InputReplicationMode,
    ValueContext,
)
from mpistrat.losses import compute_average_loss, scale_regularization_loss
from mpistrat.options import CommunicationImplementation, CommunicationOptions
from mpistrat.preemption import PreemptionCheckpointHandler, PreemptionWatcher, TerminationConfig
from mpistrat.reduce_op import ReduceOp
from mpistrat.replica_context import ReplicaContext
from mpistrat.stragglers import StragglerRow, Stragglers
from mpistrat.strategy import MPIStrategy, MultiWorkerMirroredStrategy, Strategy
from mpistrat.timeline import start_timeline, stop_timeline, trace
from mpistrat.values import DistributedValues, Mirrored, PerReplica
from mpistrat.variables import (
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    VariableSynchronization,
)

__version__ = "0.1.0"

__all__ = [
    "MPI",
    "ArrayDataset",
    "ArraySpec",
    "Checkpoint",
    "CheckpointLoadStatus",
    "CheckpointManager",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
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
    "PerReplica",
    "PreemptionCheckpointHandler",
    "PreemptionWatcher",
    "ReduceOp",
    "ReplicaContext",
    "Strategy",
    "StrategyExtended",
    "StragglerRow",
    "Stragglers",
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
