"""MPIStrategy and MultiWorkerMirroredStrategy: one MPI rank per replica.

:class:`~mpistrat.Strategy` itself is in ``strategy_base.py``, the default single-replica
strategy in ``default.py``; both names are importable from here too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from mpistrat import config
from mpistrat.diagnostics import abort, launch, watchdog
from mpistrat.distribute.extended import StrategyExtended
from mpistrat.distribute.strategy_base import Strategy
from mpistrat.errors import (
    ContextError,
    InvalidArgumentError,
    MpistratError,
    PeerFailedError,
    UnsupportedTypeError,
)
from mpistrat.interface import modes
from mpistrat.options import CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.distribute.cluster_resolver import ClusterResolver
    from mpistrat.distribute.recovery import Recovery

__all__ = ["Strategy", "MPIStrategy", "MultiWorkerMirroredStrategy"]

_ALWAYS = CommunicationOptions(check=True)  # the check holds whatever MPISTRAT_CHECK says
MERGE_CALLS = ("root", "every_rank")  # where merge_call runs merge_fn (distribute/merge.py)


class MPIStrategy(Strategy):
    """Synchronous data parallelism with one replica per MPI rank.

    >>> import mpistrat
    >>> strategy = mpistrat.MPIStrategy()  # every rank of COMM_WORLD is a replica
    >>> strategy.num_replicas_in_sync == mpistrat.MPI.COMM_WORLD.Get_size()
    True

    Args:
        comm: the intracommunicator whose ranks are the replicas (default
            ``MPI.COMM_WORLD``); the strategy talks on a private duplicate of it.
            Creating the strategy is collective over ``comm``. A process that MPI started
            alone although its launcher started several (``srun`` without the PMI plugin the
            MPI library speaks, another MPI's ``mpiexec``) raises ``ContextError`` with the fix
            (``MPISTRAT_ALLOW_SINGLETON=1`` lets independent one-rank tasks run).
        communication_options: defaults for every collective.
        merge_call: where ``ReplicaContext.merge_call`` runs ``merge_fn``: ``"root"``
            (gather to rank 0, run once, broadcast; any merge_fn) or ``"every_rank"``
            (every rank runs it on its own values; reductions inside are collectives,
            so the variable-update pattern costs one all-reduce at any scale). See
            :mod:`mpistrat.distribute.merge`. The optimizers use ``"every_rank"`` either way.
    """

    def __init__(
        self,
        comm: MPI.Intracomm | None = None,
        *,
        communication_options: CommunicationOptions | None = None,
        merge_call: str = "root",
    ):
        launch.check(MPI.COMM_WORLD.Get_size())  # a task that MPI started alone must not train alone
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise UnsupportedTypeError(f"MPIStrategy: comm must be an mpi4py intracommunicator; got {comm!r}")
        if merge_call not in MERGE_CALLS:
            raise InvalidArgumentError(
                f"MPIStrategy: merge_call must be 'root' or 'every_rank'; got {merge_call!r}"
            )
        options = CommunicationOptions().merge(communication_options)
        abort.install()  # an uncaught exception on one rank now ends the job, not just that rank
        timeout = options.timeout_seconds or config.read("MPISTRAT_TIMEOUT")
        what = f"{type(self).__name__}()"
        private = watchdog.duplicate(comm, timeout, what) if comm.Get_size() > 1 else comm.Dup()
        super().__init__(StrategyExtended(self, private, options, merge_call=merge_call))
        self._cluster_resolver: ClusterResolver | None = None

    def recover(self) -> Recovery:
        """Go on with the surviving ranks after one died: call it on every survivor, in cross-replica
        context, once ``PeerFailedError`` was raised (collective over the survivors).

        Where MPI can go on without the lost ranks (ULFM: Open MPI 5 launched with
        ``mpiexec --with-ft ulfm``), it rebuilds the strategy on the survivors
        (``num_replicas_in_sync`` drops), gives every survivor the state of the furthest step any of
        them completed (a step none completed is done again), and moves its distributed iterators
        back to the first global batch not yet applied, split over the survivors: the loop just goes
        on. It returns what it did (:class:`~mpistrat.distribute.recovery.Recovery`: the ranks lost,
        the step, the seconds), which rank 0 also logs. Elsewhere, or below
        ``MPISTRAT_MIN_REPLICAS``, it raises ``PeerFailedError`` on every survivor.

        A loop that calls ``strategy.run`` itself::

            while int(optimizer.iterations.numpy()) < steps:
                try:
                    strategy.run(train_step, args=(next(iterator),))
                except mpistrat.PeerFailedError:
                    strategy.recover()

        ``PreemptionCheckpointHandler.run`` and ``next(iterator)`` recover by themselves.
        See docs/fault-tolerance.md.
        """
        mode = modes.current_mode()
        if mode.kind is not modes.DEFAULT and (mode.strategy is not self or mode.replica_context is not None):
            raise ContextError(
                "MPIStrategy.recover() must be called in cross-replica context (outside strategy.run and "
                "merge_fn), on every surviving rank"
            )
        from mpistrat.diagnostics import ulfm  # few jobs lose a rank
        from mpistrat.distribute import recovery

        live, why = ulfm.fault_tolerance()
        if not live:
            raise PeerFailedError(
                f"MPIStrategy.recover: this launch cannot go on after a rank's death: {why}"
            )
        self._cluster_resolver = None
        return recovery.recover(self._extended)

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """This rank's place in the cluster: ``task_type="worker"``, ``task_id`` the rank.

        ``cluster_spec()`` has one ``"worker"`` address per rank: its host name (from MPI) and a
        port that means nothing (MPI connects the ranks). See :mod:`mpistrat.cluster_resolver`.

        >>> import mpistrat
        >>> resolver = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF).cluster_resolver
        >>> resolver.task_type, resolver.task_id, resolver.cluster_spec().num_tasks("worker")
        ('worker', 0, 1)
        """
        if self._cluster_resolver is None:
            from mpistrat.distribute.cluster_resolver import MPIClusterResolver  # few jobs ask

            extended = self._extended
            placement = extended.placement
            self._cluster_resolver = MPIClusterResolver(extended.rank, placement.hosts, placement.gpu)
        return self._cluster_resolver


class MultiWorkerMirroredStrategy(MPIStrategy):
    """tf's ``MultiWorkerMirroredStrategy``: every rank of ``MPI.COMM_WORLD`` is a worker with one replica.

    It is :class:`MPIStrategy` over ``COMM_WORLD`` with ``merge_call="every_rank"``: as on tf's
    workers, ``merge_fn`` runs on every rank with its own values and reductions inside it are
    collectives. Creating it is collective.

    >>> import mpistrat
    >>> strategy = mpistrat.MultiWorkerMirroredStrategy()
    >>> strategy.cluster_resolver.task_type
    'worker'

    Args:
        cluster_resolver: None (MPI says who the workers are), or a resolver (a
            :class:`~mpistrat.cluster_resolver.SlurmClusterResolver`, ``TFConfig...``,
            ``Simple...``) that must describe this MPI job: as many chief and worker tasks as
            ranks, and this rank's task at its rank (the chief first). Otherwise every rank
            raises ``InvalidArgumentError``. MPI is used either way; ``cluster_resolver``
            returns the resolver given.
        communication_options: a :class:`~mpistrat.CommunicationOptions`, defaults for every
            collective.
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
    ):
        problem = None if cluster_resolver is None else _resolver_problem(cluster_resolver)
        # Created first, bounded in time (a rank that failed before it ends the job): then the check
        super().__init__(MPI.COMM_WORLD, communication_options=communication_options, merge_call="every_rank")
        if problem is not None:
            try:
                _agree_on_resolver(self, problem)
            except MpistratError:
                self.experimental_finalize()
                raise
            self._cluster_resolver = cluster_resolver


def _resolver_problem(resolver: Any) -> str:
    """What keeps ``resolver`` from describing COMM_WORLD at this rank ("" if nothing); no communication."""
    from mpistrat.distribute.cluster_resolver import (
        ClusterResolver,
        worker_index,
    )  # imported with the resolver

    try:
        if not isinstance(resolver, ClusterResolver):
            raise UnsupportedTypeError(
                "MultiWorkerMirroredStrategy: cluster_resolver must be an mpistrat.cluster_resolver."
                f"ClusterResolver or None; got {type(resolver).__name__}"
            )
        index, count, problem = worker_index(resolver)
    except (MpistratError, ValueError, TypeError, RuntimeError, KeyError) as exc:
        return f"{type(exc).__name__}: {exc}"
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if not problem and count != size:
        problem = f"it describes {count} chief and worker tasks, but MPI started {size} ranks"
    elif not problem and index != rank:
        problem = (
            f"its task ({resolver.task_type!r}, {resolver.task_id}) is task {index} of the cluster, but "
            f"this is MPI rank {rank}"
        )
    return problem


def _agree_on_resolver(strategy: MPIStrategy, problem: str) -> None:
    """Every rank raises unless every rank's resolver describes COMM_WORLD (collective, on the strategy's
    watched communicator: one handshake when all agree, the problems gathered when one does not)."""
    collectives = strategy.extended.collectives
    kind = "MultiWorkerMirroredStrategy(cluster_resolver)"
    bad = collectives.agree(kind, maximum=int(bool(problem)), options=_ALWAYS)
    if not bad:
        return
    problems = collectives.gather_to_root(problem, kind=kind)
    collectives.on_root(lambda: _raise_problems(problems or []), kind=kind)


def _raise_problems(problems: list[str]) -> None:
    from mpistrat.collectives import mismatch  # the resolvers differ: not every job's path

    bad: dict[str, list[int]] = {}
    for r, p in enumerate(problems):
        if p:
            bad.setdefault(p, []).append(r)
    where = "; ".join(f"{mismatch.rank_list(rs)}: {p}" for p, rs in bad.items())
    raise InvalidArgumentError(
        f"MultiWorkerMirroredStrategy: the cluster_resolver does not describe this MPI job ({where}). MPI "
        "decides the workers: launch as many ranks as the resolver has tasks (srun gives each its "
        "SLURM_PROCID as its rank), or pass no cluster_resolver"
    )
