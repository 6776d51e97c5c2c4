"""mpistrat: the tf.distribute programming model on MPI, for NumPy and CuPy arrays.

>>> import mpistrat, numpy as np
>>> strategy = mpistrat.MPIStrategy()
>>> def step(x):
...     ctx = mpistrat.get_replica_context()
...     return ctx.all_reduce("sum", x)
>>> total = strategy.run(step, args=(np.ones(3),))
"""

import sys as _sys

from mpi4py import MPI

from mpistrat import experimental, nest
from mpistrat.checkpoint import preemption as _preemption
from mpistrat.checkpoint.checkpoint import Checkpoint, CheckpointLoadStatus, latest_checkpoint
from mpistrat.checkpoint.manager import CheckpointManager
from mpistrat.checkpoint.preemption import PreemptionCheckpointHandler, PreemptionWatcher, TerminationConfig
from mpistrat.context import experimental_set_strategy, has_strategy, in_cross_replica_context
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
    StructureMismatchError,
    UnsupportedTypeError,
)
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
from mpistrat.options import CheckpointOptions, CommunicationImplementation, CommunicationOptions
from mpistrat.reduce_op import ReduceOp
from mpistrat.training import metrics, optimizers
from mpistrat.training.distributed_variables import MirroredVariable, SyncOnReadVariable
from mpistrat.training.losses import compute_average_loss, scale_regularization_loss
from mpistrat.training.variables import Variable, VariableAggregation, VariableSynchronization
from mpistrat.values import DistributedValues, Mirrored, PerReplica

__version__ = "0.1.0"

# The public namespaces that live in a layer folder answer to their public names too, as
# os.path does: `from mpistrat.optimizers import SGD` works as in tf.keras.
for _namespace in (cluster_resolver, metrics, optimizers, _preemption):
    _sys.modules[f"{__name__}.{_namespace.__name__.rsplit('.', 1)[1]}"] = _namespace
del _namespace
_sys.modules[f"{__name__}.optimizers.schedules"] = optimizers.schedules


def __getattr__(name: str) -> None:
    # tf's MirroredStrategy is one process driving every device of one machine; here a replica is
    # an MPI rank, so the name would run a tf program on one replica, silently (docs/migrating.md).
    if name == "MirroredStrategy":
        raise AttributeError(
            "mpistrat has no MirroredStrategy: tf's drives every GPU of one machine from one process, "
            "mpistrat runs one replica per MPI rank. Use mpistrat.MPIStrategy() (or "
            "MultiWorkerMirroredStrategy()) and launch one rank per device: mpiexec -n <devices> python ..."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
