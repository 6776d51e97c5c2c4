"""Nest-level collectives over one private communicator, one file per collective.

==================  ==========================================================
``handshake.py``    :func:`agree`: the agreement every collective opens with; the stop state
``fingerprint.py``  the codes the handshake compares: every hash, and its memo
``mismatch.py``     what each rank passed, explained once the ranks disagree
``leaves.py``       nests to arrays; cached fingerprints and pack plans
``caches.py``       what the collectives remember between calls
``state.py``        what a collective sees of its ``Collectives`` (a protocol)
``all_reduce.py``   sum or mean, one ``Allreduce`` per dtype pack
``exact_sum.py``    exact sums in integer limbs (``deterministic=True``)
``compressed.py``   16-bit values on the wire (``compression="bf16"|"fp16"``)
``hierarchical.py`` 16-bit values between nodes only (``HIERARCHICAL`` with compression)
``reduce_axis.py``  sum or mean along an axis and across ranks (a ``reduce`` with an ``axis``)
``all_gather.py``   concatenate along an axis, uneven sizes, ``Allgatherv``
``broadcast.py``    root's arrays everywhere, one ``Bcast`` per pack
``objects.py``      pickled transfers to and from rank 0, and :func:`on_root`
``in_place.py``     one flat buffer in place, after the caller's own handshake
``failure.py``      what a collective that fails on some ranks tells the rest of the program
==================  ==========================================================

A new collective is a function ``name(self: CollectiveState, ..., *, kind=...)`` in a file
of its own (``state.CollectiveState``: what a collective may use of its ``Collectives``),
decorated with ``@watchdog.collective("name")`` (stalls and timeouts), opening with
``self.agree(kind, fingerprint=..., describe=..., error=...)``, and assigned as a method below,
as a ``_Deferred`` (its file imported at first use) unless every strategy uses it.

>>> from mpi4py import MPI
>>> c = Collectives(MPI.COMM_SELF.Dup())
>>> c.all_reduce("sum", {"a": 1, "b": [40, 1]})
{'a': np.int64(1), 'b': [np.int64(40), np.int64(1)]}
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from mpistrat import config
from mpistrat.collectives import all_reduce, caches, handshake
from mpistrat.collectives.fingerprint import hash64
from mpistrat.collectives.handshake import check_enabled, check_level
from mpistrat.collectives.leaves import to_arrays
from mpistrat.collectives.stop import StopState
from mpistrat.collectives.sum_modes import route_code, sum_mode
from mpistrat.comm.transport import Transports
from mpistrat.diagnostics import flight, monitor, startup, stragglers, timeline, watchdog
from mpistrat.errors import ContextError, InvalidArgumentError
from mpistrat.options import CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.collectives.recoverables import Recoverables
    from mpistrat.collectives.step_check import StepCheck

__all__ = ["Collectives", "check_enabled", "check_level", "to_arrays"]

FREED = "this strategy was finalized (experimental_finalize); create a new MPIStrategy"


class _Deferred:
    """A method of ``Collectives`` whose module is imported when the method is first used; the
    class then holds the function itself.

    >>> Collectives.exchange.__module__, Collectives.__dict__["exchange"].__name__
    ('mpistrat.collectives.in_place', 'exchange')
    """

    def __init__(self, module: str, function: str = ""):
        self.module, self.function = module, function

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.function = name, self.function or name

    def __get__(self, instance: Any, owner: type) -> Any:
        function = getattr(importlib.import_module(f"{__name__}.{self.module}"), self.function)
        setattr(owner, self.name, function)
        return function.__get__(instance, owner)


def _monitor_twin(setting: Any) -> type[monitor.Monitor]:
    """The monitor whose marks a closing under check ``setting`` writes (step_check.monitor_twin)."""
    if setting != "step":
        return monitor.PythonMonitor
    from mpistrat.collectives import step_check  # MPISTRAT_CHECK=step only

    return step_check.monitor_twin()


class Collectives:
    """Collectives on nests of arrays over ``comm`` (which the caller owns and has duplicated)."""

    def __init__(
        self, comm: MPI.Intracomm, options: CommunicationOptions | None = None, owner: str = "Collectives"
    ):
        self.freed = False  # set by free(): its owner freed the communicator (see require_open)
        self.options = options or CommunicationOptions()
        self.owner = owner
        # How float sums travel by default (plain MPI, exact, 16-bit): the one-array fast path is plain only.
        self.sum_mode = sum_mode(self.options)
        self.disagreements = 0  # failed handshakes so far (each raised on every rank)
        self.failures = 0  # collectives that raised so far (a failed handshake, a timeout, a transfer)
        # A stop requested here (a preemption signal) that the handshake carries to every rank.
        self.stop = StopState()
        # Work started over this communicator that every rank must finish before it is freed (a
        # background checkpoint save): name -> what finishes it (collective).
        self.pending: dict[str, Callable[[], None]] = {}
        # Work that strategy.run gives a turn at the end of each step while it is pending, on every rank
        # at the same point (a background save put in place once every rank wrote its share): name ->
        # what does it (collective). Empty, a step sends nothing for it.
        self.after_step: dict[str, Callable[[], None]] = {}
        # What abandons such work when the communicator is lost (a rank died): name -> local call.
        self.abandon: dict[str, Callable[[], None]] = {}
        # Optimizer steps applied over these collectives (counted alike on every rank), and what a
        # recovery after a rank's death repairs (distribute/recovery.py).
        self.commits = 0
        self.torn = False  # this rank's replicated state is being replaced (a recovery not finished)
        self._bind(comm, "strategy creation")

    @functools.cached_property
    def recoverables(self) -> Recoverables:
        """What a recovery after a rank's death repairs (``distribute/recovery.py``): the variables,
        optimizers and iterators made over these collectives register here (made on first use: a
        job without them never loads it)."""
        from mpistrat.collectives.recoverables import Recoverables

        return Recoverables()

    def rebind(self, comm: MPI.Intracomm) -> None:
        """Go on over ``comm``, the survivors of this object's communicator after a rank died
        (collective over ``comm``): numbering, caches, transports, the handshake and the watch start
        afresh; the options and a requested stop are kept. Work in :attr:`abandon` (begun over the
        lost communicator) is abandoned, and takes its entries in :attr:`pending` and
        :attr:`after_step` with it; other work there goes on over ``comm`` (a save waiting for an
        accumulation window's end). The caller releases the old monitor, communicator and requests
        (:meth:`closer`, taken before)."""
        for abandon in list(self.abandon.values()):
            abandon()
        self.abandon.clear()
        self._bind(comm, "recovery")

    def revoke(self) -> None:
        """Revoke the communicator and those made from it (ULFM; local): every survivor's pending and
        next operation on them fails at once, so all of them reach the recovery."""
        from mpistrat.diagnostics import ulfm  # a rank died: not every job's path

        ulfm.revoke(self.comm)
        for comm in self.transports.communicators():
            ulfm.revoke(comm)

    def _bind(self, comm: MPI.Intracomm, kind: str) -> None:
        """Everything built on ``comm``; the opening handshake ``kind`` checks every rank alike."""
        self.comm = comm
        comm.Set_errhandler(MPI.ERRORS_RETURN)  # MPI's errors return to failure.from_mpi, not abort
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.hosts: tuple[str, ...] = ()  # every rank's host, once known (locate)
        self.seq = 0  # collectives so far: every rank numbers them the same
        self.caches = caches.Caches()  # what its collectives remember between calls
        self.transports = Transports(comm)  # per array module: MPI, CUDA-aware MPI, staging, NCCL
        # The handshake's send and receive buffers, reused; the persistent collective over them
        # (None where MPI lacks it); the same as MPI messages (mpi4py then skips reading their type
        # on every call); the stop state it carries.
        send, recv = (np.empty(handshake.SLOTS, dtype=np.int64) for _ in range(2))
        messages = ([send, MPI.INT64_T], [recv, MPI.INT64_T])
        request = handshake.persistent(comm, send, recv)
        self.handshake_buffers = (send, recv, request, messages, self.stop)
        # The MPI requests freed with the communicator (closer). A handshake whose wait raised takes
        # its request out: it may still be active, and freeing an active request is erroneous (Open
        # MPI: MPI_ERR_REQUEST), so it is left to MPI_Finalize.
        self.requests: list[MPI.Prequest] = [] if request is None else [request]
        # A learned step's closing compiled (a native_step.Closing), made at its first;
        # False: none (not built, the step check's Python twin, or not this strategy's kind of watch).
        self.native_closing: Any = None
        # The check: the options', else the environment (read once, here). Under ``step`` the
        # handshakes that are sent check at level 1, and repeats are checked once per step.
        setting = config.read("MPISTRAT_CHECK") if self.options.check is None else self.options.check
        self.check: int = handshake.level(setting)
        checking = "step" if setting == "step" else f"level {self.check}"
        self.step_check: StepCheck | None = None  # set once every rank agreed on the setting, below
        error = None
        try:
            timeline.from_environment(config.read("MPISTRAT_TIMELINE"))
        except InvalidArgumentError as exc:  # raised on this rank alone: every rank must fail with it
            error = exc
        self.stragglers = stragglers.Tally(
            self.rank,
            self.size,
            config.read("MPISTRAT_STRAGGLER_MS"),
            config.read("MPISTRAT_STRAGGLER_SUMMARY"),
            stragglers.world_ranks(comm),
        )
        self.flight = flight.Flight(config.read("MPISTRAT_FLIGHT_RECORDS"), self.owner, self.size)
        # Its marks are the compiled closing's under MPISTRAT_CHECK=step (where the step check runs
        # its compiled twin); it reads MPISTRAT_TIMEOUT and the stall setting.
        self.monitor = watchdog.watch(self, _monitor_twin(setting))
        # Every rank must check alike (a rank that skips the handshake would strand the others).
        route = self.options.implementation.value
        self.agree(
            kind,
            fingerprint=hash64(checking) ^ route_code(self.options.implementation),
            describe=lambda: {
                "leaves": [
                    ("the check", checking, None),
                    ("CommunicationOptions.implementation", route, None),
                ],
                "advice": "Every rank must use the same MPISTRAT_CHECK or CommunicationOptions.check, "
                "and the same CommunicationOptions.implementation.",
            },
            error=error,
            extras=[],
        )
        if setting == "step":
            from mpistrat.collectives import step_check  # MPISTRAT_CHECK=step only

            self.step_check = self.flight.step = step_check.twin()
            if self.size == 1:  # nobody to differ from, and strategy.run sends no closing handshake
                self.step_check.learned()
        self.seq = self.monitor.completed = 0  # the program's first collective is #1 in messages
        startup.reached("first collective")  # for mpistrat info --startup: the first strategy's is
        self.stragglers.forget()  # ranks arrive at creation as they start up: not a straggler

    @property
    def handshakes(self) -> int:
        """Handshakes so far (a preemption check runs one when none came): the monitor counts them."""
        return self.monitor.handshakes

    def locate(self, hosts: tuple[str, ...], processes: tuple[tuple[str, int], ...] = ()) -> None:
        """Every rank's host name (in rank order), named in stall warnings, timeouts and the straggler
        table where the ranks span several hosts (on one host it would say nothing new); every rank's
        process (``comm.devices.process_identity``): where MPI does not report a rank's death, each
        rank watches one on its machine (``diagnostics/deaths.py``)."""
        if processes and self.monitor.watched:  # several ranks: not a minimal job's path
            from mpistrat.diagnostics import deaths, ulfm

            if not ulfm.live():
                self.monitor.deaths = deaths.watch(processes, self.rank)
        self.hosts = tuple(hosts)  # where a sharded optimizer's keepers go (training/shard_copies.py)
        several = self.hosts if len(set(hosts)) > 1 else ()
        self.monitor.hosts = self.stragglers.hosts = several

    def finish_pending(self) -> None:
        """Finish the work in :attr:`pending` (collective: before the communicator is freed)."""
        while self.pending:
            self.pending.popitem()[1]()

    def step_ended(self) -> None:
        """A ``strategy.run`` step ended on every rank: :attr:`after_step`'s work runs (collective)."""
        for work in list(self.after_step.values()):
            work()

    def closer(self) -> Callable[[], None]:
        """What frees this object's own MPI objects (its transports, :attr:`requests`) before its
        communicator is freed; it holds no reference to this object (a finalizer calls it)."""
        return functools.partial(_close, self.transports, self.requests)

    def free(self) -> None:
        """Mark the communicator freed (its strategy was finalized): ``require_open`` then raises."""
        self.freed = True

    def require_open(self) -> None:
        """Raise ``ContextError`` once freed: for holders that outlive the strategy (an iterator)."""
        if self.freed:
            raise ContextError(FREED)

    agree = handshake.agree
    all_reduce = all_reduce.all_reduce
    # Imported at first use (a job that never gathers never reads all_gather.py)
    reduce_along_axis = _Deferred("reduce_axis")
    all_gather = _Deferred("all_gather")
    broadcast = _Deferred("broadcast")
    gather_to_root = _Deferred("objects")
    broadcast_from_root = _Deferred("objects")
    scatter_from_root = _Deferred("objects")
    on_root = _Deferred("objects")
    failed_in_mpi = _Deferred("failure", "from_mpi")
    all_reduce_in_place = _Deferred("in_place")
    reduce_scatter_in_place = _Deferred("in_place")
    all_gather_in_place = _Deferred("in_place")
    all_gather_bytes = _Deferred("in_place")
    exact_mean_in_place = _Deferred("in_place")
    exchange = _Deferred("in_place")
    all_to_all_bytes = _Deferred("in_place")


def _close(transports: Transports, requests: list[MPI.Prequest]) -> None:
    transports.close()
    while requests:
        requests.pop().Free()
