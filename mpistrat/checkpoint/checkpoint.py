"""Checkpoints of variables and optimizers in ``tf.train.Checkpoint``'s shape, written by every rank.

This module is the API: every rank calls :meth:`Checkpoint.save`, :meth:`~Checkpoint.write`,
:meth:`~Checkpoint.restore`, :meth:`~Checkpoint.read` and :meth:`~Checkpoint.sync` (they are
collective, in cross-replica context). A checkpoint is one file in the safetensors layout
(:mod:`~mpistrat.checkpoint.format`): every rank writes its share of it
(:mod:`~mpistrat.checkpoint.saving`) and on restore reads what it will hold
(:mod:`~mpistrat.checkpoint.restoring`), so it restores at any number of ranks, sharded or not.
Sync-on-read variables are saved aggregated. ``save(prefix)`` numbers its files ``prefix-1``,
``prefix-2``, ... by ``save_counter`` (saved in the file, so a restored checkpoint continues
the numbering) and records the newest in the directory's index, which :func:`latest_checkpoint`
reads. Files are written under a temporary name and renamed once complete, so a killed save
leaves the previous checkpoint intact; errors on any rank reach every rank.

>>> import mpistrat, numpy as np, os, tempfile
>>> w = mpistrat.Variable(np.arange(3.0))
>>> ckpt = mpistrat.Checkpoint(model={"w": w})
>>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> os.path.basename(ckpt.save(prefix)), os.path.basename(ckpt.save(prefix))
('ckpt-1', 'ckpt-2')
>>> _ = w.assign(np.zeros(3))
>>> status = ckpt.restore(latest_checkpoint(os.path.dirname(prefix)))
>>> status.assert_consumed() is status, w.numpy()
(True, array([0., 1., 2.]))
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

from mpistrat.checkpoint import background, local_copies, mpiio, restoring, saving
from mpistrat.checkpoint.files import INDEX, Listing, checkpoint_state, read_table
from mpistrat.checkpoint.format import Table, renamed
from mpistrat.checkpoint.status import CheckpointLoadStatus
from mpistrat.checkpoint.tracking import name_before_escaping, tracked
from mpistrat.collectives.fingerprint import hash64
from mpistrat.errors import ContextError, InvalidArgumentError, PeerFailedError
from mpistrat.interface import modes
from mpistrat.interface.protocols import StrategyProtocol
from mpistrat.interface.saved_entry import PositionEntry, SavedEntry
from mpistrat.log import logger
from mpistrat.options import CheckpointOptions
from mpistrat.training.optimizers import LossScaleOptimizer, Optimizer
from mpistrat.training.saved_variable import SavedVariable, saved_slot
from mpistrat.training.variables import Variable, plain_variable

if TYPE_CHECKING:
    from mpistrat.collectives import Collectives

__all__ = ["Checkpoint", "CheckpointLoadStatus", "latest_checkpoint"]

SAVE_COUNTER = "save_counter"  # Checkpoint.save_counter's name, as tf's: reserved


class Checkpoint:
    """Save and restore named variables, optimizers, nests of them and objects holding them.

    Entries are named by their keyword and key path, e.g. ``model/w``, or attribute path
    for an object holding variables (a model class: ``model/dense/kernel``, see
    :mod:`~mpistrat.checkpoint.tracking`). An optimizer contributes ``<name>/iterations``,
    ``<name>/learning_rate`` (a number's; as in Keras, a restore sets it back), a
    ``LossScaleOptimizer`` its ``<name>/loss_scale/...`` and one entry per slot,
    ``<name>/slots/<variable's entry>/<slot>``, so its variables must be tracked by the same
    checkpoint. A distributed dataset or iterator contributes
    its position (the pass and the examples taken in it), which ``restore`` sets back, so
    the next pass resumes there. Every file also holds ``save_counter``.

    Args:
        **trackables: ``Variable``, optimizer, a distributed dataset or iterator, a
            dict/list/tuple nest of them (a metric's ``variables`` too), or an object that
            holds them as attributes (a model).
    """

    def __init__(self, **trackables: Any):
        self._variables: dict[str, Variable] = {}
        self._optimizers: dict[str, Optimizer | LossScaleOptimizer] = {}
        self._positions: dict[str, PositionEntry] = {}
        for key, value in trackables.items():
            if key.startswith("__") or key == SAVE_COUNTER:
                raise InvalidArgumentError(
                    f"Checkpoint: {SAVE_COUNTER!r} and names starting with '__' are reserved; got {key!r}"
                )
            for name, leaf in tracked(key, value):
                if name in self._variables or name in self._optimizers or name in self._positions:
                    raise InvalidArgumentError(
                        f"Checkpoint: two tracked objects are named {name!r} (keys whose text is the same, "
                        "such as 1 and '1'); rename one"
                    )
                if isinstance(leaf, Variable):
                    self._variables[name] = leaf
                elif isinstance(leaf, (Optimizer, LossScaleOptimizer)):
                    self._optimizers[name] = leaf
                else:
                    self._positions[name] = leaf
        # Plain on every rank: saves and restores are collective, so every rank holds the same count.
        self._save_counter = plain_variable(np.zeros((), np.int64), SAVE_COUNTER)
        self._warned_mid_window = False  # said once: a save part-way through an accumulation window

    @property
    def save_counter(self) -> Variable:
        """How many times :meth:`save` has run (restored with the checkpoint): it numbers the files."""
        return self._save_counter

    # -- what is saved --------------------------------------------------------------------

    def _entries(self) -> dict[str, SavedEntry]:
        """Every entry (``interface/saved_entry.py``: a variable, an optimizer's slot or cycle, an
        input's position), in name order (the same on every rank)."""
        entries: dict[str, SavedEntry] = {n: SavedVariable(v) for n, v in self._variables.items()}
        entries.update(self._positions)
        names = {id(v): n for n, v in self._variables.items()}
        for opt_name, opt in self._optimizers.items():
            entries.update((f"{opt_name}/{name}", SavedVariable(v)) for name, v in opt.tracked().items())
            for var, slots in opt.slots_by_variable():
                if id(var) not in names:
                    raise InvalidArgumentError(
                        f"Checkpoint: optimizer {opt_name!r} has slots for variable {var.name!r}, which this "
                        "checkpoint does not track; pass that variable to Checkpoint(...) too"
                    )
                for slot_name, slot in slots.items():
                    entries[f"{opt_name}/slots/{names[id(var)]}/{slot_name}"] = saved_slot(slot)
            if (cycle := opt.accumulation_state()) is not None:  # saved mid-cycle
                count, shares = cycle
                entries[f"{opt_name}/accumulation/count"] = SavedVariable(count)
                for var, share in shares:
                    entries[f"{opt_name}/accumulation/{self._tracked_name(names, opt_name, var)}"] = share
        return dict(sorted(entries.items()))

    def _build_slots(self, names: list[str]) -> None:
        """Create the optimizer slots a checkpoint holds for tracked variables (collective), and
        the buffers of an accumulation cycle it was saved in (none: a restored optimizer starts a
        cycle afresh)."""
        for opt_name, opt in self._optimizers.items():
            prefix = f"{opt_name}/slots/"
            wanted = {n[len(prefix) :].rsplit("/", 1)[0] for n in names if n.startswith(prefix)}
            opt.build([self._variables[w] for w in sorted(wanted) if w in self._variables])
            prefix = f"{opt_name}/accumulation/"
            cycle = {n[len(prefix) :] for n in names if n.startswith(prefix)} - {"count"}
            if f"{prefix}count" in names:
                opt.prepare_accumulation([self._variables[w] for w in sorted(cycle) if w in self._variables])
            else:
                opt.prepare_accumulation(None)

    @staticmethod
    def _tracked_name(names: dict[int, str], opt_name: str, var: Variable) -> str:
        if id(var) not in names:
            raise InvalidArgumentError(
                f"Checkpoint: optimizer {opt_name!r} accumulates gradients of variable {var.name!r}, which "
                "this checkpoint does not track; pass that variable to Checkpoint(...) too"
            )
        return names[id(var)]

    # -- what CheckpointManager and PreemptionCheckpointHandler use ---------------------------

    def strategy(self, caller: str) -> StrategyProtocol:
        """The strategy whose ranks save and restore this checkpoint: the tracked variables' and
        inputs' (all one), else the current one. ``caller`` names the method in the errors (called
        outside cross-replica context, or objects of several strategies)."""
        owners = {id(s): s for v in self._variables.values() if (s := v.distribute_strategy) is not None}
        owners.update((id(p.owner), p.owner) for p in self._positions.values())
        if len(owners) > 1:
            raise InvalidArgumentError(
                f"Checkpoint.{caller}: the tracked variables and inputs belong to different strategies"
            )
        mode = modes.current_mode()
        strategy = next(iter(owners.values())) if owners else mode.strategy
        if mode.kind in (modes.REPLICA, modes.MERGE):
            raise ContextError(
                f"Checkpoint.{caller} is collective: call it on every rank in cross-replica context "
                "(outside strategy.run and merge_fn)"
            )
        if mode.kind is not modes.DEFAULT and mode.strategy is not strategy:
            raise ContextError(
                f"Checkpoint.{caller}: the variables belong to {strategy}, not to {mode.strategy}"
            )
        return strategy

    def track(self, name: str, variable: Variable) -> None:
        """Save and restore ``variable`` under ``name`` too (the preemption handler's run count)."""
        if not isinstance(variable, Variable):
            got = type(variable).__name__
            raise InvalidArgumentError(f"Checkpoint.track: expected a Variable; got {got}")
        self._variables[name] = variable

    def accumulating(self) -> list[str]:
        """The tracked optimizers part-way through a gradient accumulation window, as ``'opt' (1 of 4
        calls)`` (the same on every rank: every rank calls ``apply_gradients`` alike)."""
        return [
            f"{name!r} ({int(cycle[0].numpy())} of {opt.gradient_accumulation_steps} calls)"
            for name, opt in self._optimizers.items()
            if (cycle := opt.accumulation_state()) is not None
        ]

    # -- save / write / restore / read -------------------------------------------------------

    def save(self, file_prefix: str | os.PathLike[str], options: CheckpointOptions | None = None) -> str:
        """Write a numbered checkpoint ``<file_prefix>-<n>`` (collective); returns its path.

        ``n`` is ``save_counter + 1``, and ``save_counter`` becomes ``n`` once the file is
        written (with ``options.enable_async``: at once). The directory's index then names this
        file as the latest, for :func:`latest_checkpoint` (use :class:`CheckpointManager` to keep
        several).
        """
        background.wait_for_saves(self.strategy("save").extended.collectives)  # it may take a number
        path = f"{os.fspath(file_prefix)}-{int(self._save_counter.numpy()) + 1}"
        self.save_as(path, options, Listing(os.path.dirname(path) or ".", [path]))
        return path

    def save_as(
        self,
        path: str | os.PathLike[str],
        options: CheckpointOptions | None = None,
        listing: Listing | None = None,
        in_place: Callable[[], None] = lambda: None,
    ) -> None:
        """:meth:`save` to ``path`` (collective; :class:`CheckpointManager` names its files): counted
        in ``save_counter`` (not if it fails); once the file is in place, rank 0 records ``listing``
        in the directory's index, then every rank runs ``in_place`` (with ``options.enable_async``:
        when the background save is put in place)."""
        collectives = self.strategy("save").extended.collectives
        background.wait_for_saves(collectives)
        counter = int(self._save_counter.numpy()) + 1
        self._save_counter.assign(np.int64(counter))
        try:
            self._write(collectives, os.fspath(path), "save", counter, options, listing, in_place)
        except BaseException:
            self._save_counter.assign(np.int64(counter - 1))  # a failed save does not count
            raise

    def write(self, file_path: str | os.PathLike[str], options: CheckpointOptions | None = None) -> str:
        """Write a checkpoint to exactly ``file_path`` (collective); returns it.

        Unnumbered, and not recorded in the directory's index; read it back with :meth:`read`.
        """
        path = os.fspath(file_path)
        if os.path.basename(path) == INDEX:
            raise InvalidArgumentError(
                f"Checkpoint.write: {INDEX!r} is the index file's name; pick another name"
            )
        collectives = self.strategy("write").extended.collectives
        self._write(collectives, path, "write", int(self._save_counter.numpy()), options)
        return path

    def _write(
        self,
        collectives: Collectives,
        path: str,
        method: str,
        counter: int,
        options: CheckpointOptions | None,
        listing: Listing | None = None,
        in_place: Callable[[], None] = lambda: None,
    ) -> None:
        """Every rank writes its share to rank 0's ``path`` (collective), then :meth:`save_as`'s
        ``listing`` and ``in_place``. With ``options.enable_async`` it returns once this rank's share
        is copied aside: the next checkpoint call (or a step's end, or the end of the job) finishes
        the file. A background save still being written is finished first."""
        options = _checked_options(options, f"Checkpoint.{method}")
        background.wait_for_saves(collectives)
        if not self._warned_mid_window and (windows := self.accumulating()):
            self._warned_mid_window = True
            logger.warning(
                "Checkpoint.%s: saved part-way through a gradient accumulation window (optimizer %s): the "
                "file holds each rank's accumulated gradients, so it restores only at %d ranks. Saved "
                "after a window's last apply_gradients, it restores at any rank count: "
                "CheckpointManager(..., save_at_window_end=True) waits for it (said once)",
                method,
                ", ".join(windows),
                collectives.size,
            )
        save = saving.begin(
            self._entries(), collectives, path, method, counter, options.io_hints, listing, in_place
        )
        if options.enable_async:
            background.start(save, collectives)
            return
        try:
            saving.write(save, collectives)
            saving.finish(save, collectives)
        except PeerFailedError:  # a rank died mid-save: nothing stays open (MPI_Finalize would wait on it)
            saving.abandon(save, collectives)
            raise
        in_place()
        local_copies.keep(save, collectives)

    def sync(self) -> None:
        """Wait until every background save (``CheckpointOptions(enable_async=True)``) is written
        and in place (collective); a failed one raises here, on every rank."""
        background.wait_for_saves(self.strategy("sync").extended.collectives)

    def restore(
        self, save_path: str | os.PathLike[str] | None, options: CheckpointOptions | None = None
    ) -> CheckpointLoadStatus:
        """Load ``save_path`` into the tracked objects (collective); returns a status.

        Lenient, as tf's: entries the file lacks keep their values, and entries of the file
        that nothing here tracks are skipped (a warning names them unless the status's
        ``expect_partial()`` is called); ``status.assert_consumed()`` makes either an error.
        Entries whose shape or dtype differ, and a damaged file, are an error naming them;
        nothing is assigned then. ``save_counter`` is restored too. ``None`` (nothing saved
        yet) restores nothing. A background save still being written is finished first.
        """
        strategy = self.strategy("restore")
        collectives = strategy.extended.collectives
        background.wait_for_saves(collectives)
        hints = _agree_to_read(collectives, save_path, options, "restore")
        if save_path is None:
            return CheckpointLoadStatus(None, [], [])
        return self._load(
            os.fspath(save_path), "restore", collectives, strategy.extended.writes_in_sync, hints
        )

    def read(
        self, save_path: str | os.PathLike[str], options: CheckpointOptions | None = None
    ) -> CheckpointLoadStatus:
        """Load a file written by :meth:`write` (collective); as :meth:`restore`, but ``None`` is an error."""
        if save_path is None:
            raise InvalidArgumentError("Checkpoint.read: save_path must be a path; got None")
        strategy = self.strategy("read")
        collectives = strategy.extended.collectives
        background.wait_for_saves(collectives)
        hints = _agree_to_read(collectives, save_path, options, "read")
        return self._load(os.fspath(save_path), "read", collectives, strategy.extended.writes_in_sync, hints)

    def _load(
        self,
        path: str,
        method: str,
        collectives: Collectives,
        writes_in_sync: Callable[[], AbstractContextManager[None]],
        hints: dict[str, str],
    ) -> CheckpointLoadStatus:
        """Rank 0 reads the file's table of contents and every rank gets it; then every rank reads
        its part (:func:`restoring.load`, with the MPI-IO ``hints``): checked before anything is
        assigned. Node-local copies of every share (``local_copies.py``) are read instead of the
        file; the file, where one of them is damaged or unreadable (every rank hears of it)."""
        copies = local_copies.find(path, collectives)
        if copies is not None:
            try:
                return self._load_from(path, method, collectives, writes_in_sync, hints, copies)
            except (InvalidArgumentError, OSError) as exc:
                if collectives.rank == 0:
                    said = "Checkpoint.%s: the node-local copies of %s: %s; reading the file"
                    logger.warning(said, method, path, exc)
        return self._load_from(path, method, collectives, writes_in_sync, hints, None)

    def _load_from(
        self,
        path: str,
        method: str,
        collectives: Collectives,
        writes_in_sync: Callable[[], AbstractContextManager[None]],
        hints: dict[str, str],
        copies: local_copies.Copies | None,
    ) -> CheckpointLoadStatus:
        """:meth:`_load` from the file, or from ``copies``."""
        table: Table | None = (
            copies.table(collectives, method)
            if copies is not None
            else collectives.on_root(lambda: read_table(path), kind=f"checkpoint.{method} (read)")
        )
        if table is None:
            raise InvalidArgumentError(f"Checkpoint.{method}: {path} is not an mpistrat checkpoint")
        if not table.escaped:  # an earlier version's file: its names in this version's words
            table = renamed(table, name_before_escaping)
        index: restoring.Index = {n: (e.dtype, e.shape) for n, e in table.entries.items()}
        index.update({n: (np.dtype(np.int64), np.shape(p)) for n, p in table.positions.items()})
        self._build_slots(sorted(index))
        entries = self._entries()
        restoring.check_shapes(f"Checkpoint.{method}({path!r})", entries, index)
        targets = {n: v for n, v in entries.items() if n in index}
        restoring.load(table, targets, collectives, writes_in_sync, hints, method, copies)
        if table.counter is not None:
            self._save_counter.assign(np.int64(table.counter))
        missing = [n for n in entries if n not in index]
        return CheckpointLoadStatus(path, missing, [n for n in index if n not in entries])


def _agree_to_read(
    collectives: Collectives, save_path: Any, options: CheckpointOptions | None, method: str
) -> dict[str, str]:
    """The MPI-IO hints to read with, once every rank agreed to read a file (or none: ``restore(None)``)
    with the same hints: a rank that found no checkpoint, or that would open the file with other hints
    (where an MPI library may wait forever), fails every rank instead (collective)."""
    hints: dict[str, str] = {}
    error = None
    try:
        hints = mpiio.hints(_checked_options(options, f"Checkpoint.{method}").io_hints)
    except InvalidArgumentError as exc:
        error = exc
    leaves = [("save_path", "None" if save_path is None else "a path", ()), mpiio.described(hints)]
    leaves.append(saving.local_copies_described())  # every rank reads node-local copies, or none
    collectives.agree(
        "checkpoint.restore",
        fingerprint=hash64(repr(leaves)),
        describe=lambda: {
            "leaves": leaves,
            "advice": "Every rank must restore a checkpoint (or None), with the same MPI-IO hints "
            "(MPISTRAT_IO_HINTS, CheckpointOptions.io_hints), MPISTRAT_LOCAL_COPIES set on all or none.",
        },
        error=error,
        options=saving.ALWAYS,
    )
    return hints


def _checked_options(options: CheckpointOptions | None, where: str) -> CheckpointOptions:
    if options is None:
        return CheckpointOptions()
    if not isinstance(options, CheckpointOptions):
        raise InvalidArgumentError(
            f"{where}: options must be an mpistrat.CheckpointOptions (or None); got {type(options).__name__}"
        )
    return options


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The path of the newest checkpoint saved in ``directory``, or None, as ``tf.train.latest_checkpoint``.

    Read from the directory's index file. If that file exists but is unreadable
    (truncated, corrupt) or names a file that is gone, a warning says so and the
    newest valid mpistrat checkpoint file in ``directory`` (by modification time)
    is returned instead; None if there is none. No index file: None.

    Collective over the current strategy: in ``strategy.scope()`` rank 0 reads and every
    rank gets its answer; outside any scope each rank reads for itself.
    """
    mode = modes.current_mode()
    if mode.kind in (modes.REPLICA, modes.MERGE):
        raise ContextError(
            "latest_checkpoint is collective: call it on every rank in cross-replica context "
            "(outside strategy.run and merge_fn)"
        )
    collectives = mode.strategy.extended.collectives
    background.wait_for_saves(collectives)
    collectives.agree("checkpoint.latest")
    return collectives.on_root(
        lambda: checkpoint_state(os.fspath(directory))[0], kind="checkpoint.latest (read)"
    )
