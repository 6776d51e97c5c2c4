"""Going on after a rank died (ULFM): revoke, shrink, agree, rebuild, repair.

:func:`recover` is what ``MPIStrategy.recover()`` does, on every survivor, wherever each learned of
the death (a ``PeerFailedError`` out of ``strategy.run``, ``next(iterator)``, a checkpoint...):

1. **revoke** the strategy's communicators, so every survivor's pending operation fails at once;
2. **shrink**: ``MPI_Comm_shrink`` makes the survivors' communicator (a rank that dies meanwhile
   is left out too);
3. **agree**: every survivor's facts are gathered (its world rank and host, the optimizer steps it
   applied, what each registered object holds). The survivors go on from the most steps any of
   them applied (roll forward): a step some survivor completed had every rank's gradients, the
   dead rank's included, so it is kept, and a survivor that completed it is the **source** of the
   replicated state. A step no survivor completed is not applied anywhere (optimizers write only
   once a step's communication has succeeded) and is done again by the survivors, on the same
   global batch. So no step is half-applied, and at most one is lost;
4. **rebuild** the strategy on the survivors: its collectives (the same object: handshake,
   numbering, caches, transports and their sub-communicators, the watch and its side channel,
   the step check), its rank, size and reductions;
5. **repair** each object registered with the collectives (``collectives/recoverables.py``), in
   creation order: mirrored variables take the source's values, an optimizer re-shards its slots,
   an iterator moves back to the first global batch not yet applied, re-split over the survivors.

A death during 2-5 starts again from 1 with the survivors so far. The recovery refuses to go on
with fewer than ``MPISTRAT_MIN_REPLICAS`` replicas, and where a rank's state is lost with it (the
copy of its sharded slots died with it): every survivor then raises ``PeerFailedError``, and the
job ends (exit status 76) unless the program catches it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, cast

from mpi4py import MPI

from mpistrat import config
from mpistrat.diagnostics import ulfm
from mpistrat.errors import PeerFailedError
from mpistrat.log import ANY_RANK, logger

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives
    from mpistrat.distribute.extended import StrategyExtended

__all__ = ["Recovery", "recover"]


@dataclasses.dataclass
class Recovery:
    """What one recovery found and did (the same on every survivor but ``seconds``).

    ``lost``: the world ranks that died; ``step``: the optimizer steps applied that the survivors go
    on from; ``applied``: each survivor's before the recovery (in the new rank order); ``source``:
    the survivor whose replicated state the others took; ``replicas``: before and after.
    """

    lost: tuple[int, ...]
    step: int
    applied: tuple[int, ...]
    source: int
    replicas: tuple[int, int]
    seconds: float
    collectives: Collectives = dataclasses.field(repr=False)  # the strategy's, over the survivors

    def describe(self) -> str:
        lost = ", ".join(map(str, self.lost)) or "?"
        return (
            f"lost world rank{'s' if len(self.lost) != 1 else ''} {lost}; going on from optimizer step "
            f"{self.step} with {self.replicas[1]} of {self.replicas[0]} replicas (state from replica "
            f"{self.source}); recovery took {self.seconds:.3f} s"
        )


@dataclasses.dataclass
class _Facts:
    """What every survivor learns of each: its host, the steps it applied, whether its replicated
    state is half replaced (an interrupted recovery), and each registered object's own facts."""

    host: str
    applied: int
    torn: bool
    objects: dict[int, Any]


def recover(extended: StrategyExtended) -> Recovery:
    """Rebuild ``extended``'s strategy on the survivors and repair its state (collective over the
    survivors; see the module docstring). Raises ``PeerFailedError`` where it cannot go on."""
    c = extended.collectives
    began = time.monotonic()
    before = c.size
    world_before = _world_ranks(c.comm)
    comm = c.comm
    while True:
        if comm is c.comm:
            c.revoke()
        else:
            ulfm.revoke(comm)
        survivors = cast(MPI.Intracomm, comm.Shrink())  # a shrunk intracommunicator is one
        try:
            recovery = _recover_on(extended, survivors, before)
        except Exception as exc:
            if not (isinstance(exc, PeerFailedError) or ulfm.is_peer_failure(exc, c.comm)):
                raise
            if isinstance(exc, PeerFailedError) and not exc.recoverable:
                raise  # every survivor found the same: the job ends
            comm = c.comm if c.comm is survivors else survivors  # another death: again from the survivors
            continue
        world_after = set(_world_ranks(c.comm))
        recovery.lost = tuple(r for r in world_before if r not in world_after)
        recovery.seconds = time.monotonic() - began
        if c.rank == 0:
            logger.warning("MPIStrategy.recover: %s", recovery.describe(), extra=ANY_RANK)
        return recovery


def _recover_on(extended: StrategyExtended, survivors: MPI.Intracomm, before: int) -> Recovery:
    c = extended.collectives
    objects = dict(c.recoverables.items())
    mine = _Facts(
        MPI.Get_processor_name(),
        c.commits,
        c.torn,
        {key: obj.recovery_facts() for key, obj in objects.items()},
    )
    facts: list[_Facts] = survivors.allgather(mine)
    minimum = config.read("MPISTRAT_MIN_REPLICAS")
    if len(facts) < minimum:
        _fail(
            f"only {len(facts)} of {before} replicas are left, fewer than MPISTRAT_MIN_REPLICAS={minimum}: "
            "the job cannot go on (restore the last checkpoint at a size you allow)"
        )
    step = max(f.applied for f in facts)
    sources = [r for r, f in enumerate(facts) if f.applied == step and not f.torn]
    if not sources:
        _fail(
            f"every survivor that had applied optimizer step {step} is lost, and the others hold part of "
            "an interrupted recovery: the job cannot go on (restore the last checkpoint)"
        )
    recovery = Recovery(
        lost=(),
        step=step,
        applied=tuple(f.applied for f in facts),
        source=sources[0],
        replicas=(before, len(facts)),
        seconds=0.0,
        collectives=c,
    )
    extended.rebind(survivors, tuple(f.host for f in facts))
    common = [key for key in objects if all(key in f.objects for f in facts)]
    c.torn = c.rank != recovery.source
    for key in common:
        objects[key].recover(recovery, [f.objects[key] for f in facts])
    c.commits = step
    c.torn = False
    return recovery


def _fail(message: str) -> None:
    raise PeerFailedError(f"MPIStrategy.recover: {message}", recoverable=False)


def _world_ranks(comm: MPI.Intracomm) -> tuple[int, ...]:
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(int(r) for r in group.Translate_ranks(None, world))
    finally:
        group.Free()
        world.Free()
