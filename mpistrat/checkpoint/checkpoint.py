"""Checkpoints of variables and optimizers in ``tf.train.Checkpoint``'s shape, surviving a killed save.

Every rank calls :meth:`Checkpoint.save`, :meth:`~Checkpoint.write`, :meth:`~Checkpoint.restore`
and :meth:`~Checkpoint.read` (they are collective, in cross-replica context). Rank 0 writes one
``.npz`` file atomically: to a temporary file, ``fsync``, then ``rename``, so the previous
checkpoint at that path stays intact until the new one is complete. ``save(prefix)`` numbers
its files ``prefix-1``, ``prefix-2``, ... by ``save_counter`` (saved in the file, so a restored
checkpoint continues the numbering) and records the newest in the directory's ``checkpoint``
index, which :func:`latest_checkpoint` reads. Sync-on-read variables are saved aggregated;
``restore`` reads on rank 0 and broadcasts, so a checkpoint restores at any number of ranks.

Faults it handles: each save removes the temporary files that killed saves left in its
directory (see :func:`_stale_temporaries`); :func:`latest_checkpoint` falls back to the newest
valid checkpoint file when the index is unreadable, with a warning; and ``restore`` of a
truncated or corrupt file raises ``InvalidArgumentError`` naming the file, on every rank.

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

import contextlib
import json
import os
import re
import socket
import time
import weakref
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from mpistrat import context, nest
from mpistrat.collectives.handshake import code
from mpistrat.errors import ContextError, InvalidArgumentError
from mpistrat.input.datasets import input_position
from mpistrat.input.position import InputPosition
from mpistrat.log import logger
from mpistrat.training.optimizers import Optimizer
from mpistrat.training.variables import Variable, _to_numpy

__all__ = ["Checkpoint", "CheckpointLoadStatus", "latest_checkpoint"]

INDEX = "checkpoint"  # in a checkpoint's directory: names the latest one
SAVE_COUNTER = "save_counter"  # the entry holding Checkpoint.save_counter, as tf names it
_META = "__mpistrat__"
_FORMAT = 1

# Temporary files are named ``<path>.tmp<pid>-<host>``. A later save in the same directory
# removes one when it is certainly abandoned: written on this host by a process that is
# no longer alive, or (another host, a reused PID, or a name from before the host was
# recorded: ``<path>.tmp<pid>``) last modified more than _STALE_AFTER seconds ago.
_TMP_NAME = re.compile(r"^(?P<target>.+)\.tmp(?P<pid>[0-9]+)(?:-(?P<host>[A-Za-z0-9._-]+))?$")
_STALE_AFTER = 3600.0
# Only files that start like what _write_atomic writes: an .npz (a zip) or the index's JSON.
_TMP_STARTS = (b"PK\x03\x04", b'{"latest"')


def _before_rename(tmp: str, path: str) -> None:
    """Called between writing the temporary file and renaming it (a seam for tests)."""


class Checkpoint:
    """Save and restore named variables, optimizers and nests (dicts, lists) of them.

    Entries are named by their keyword and key path, e.g. ``model/w``; an
    optimizer contributes ``<name>/iterations`` and one entry per slot,
    ``<name>/slots/<variable's entry>/<slot>``, so its variables must be tracked
    by the same checkpoint. A distributed dataset or iterator contributes its position
    (the pass and the batches taken in it) as one small integer entry, which ``restore``
    sets back, so the next pass resumes there. Every file also holds ``save_counter``.

    Args:
        **trackables: ``Variable``, optimizer, a distributed dataset or iterator, or a
            dict/list/tuple nest of them (a metric's ``variables`` too).
    """

    def __init__(self, **trackables: Any):
        self._variables: dict[str, Variable] = {}
        self._optimizers: dict[str, Optimizer] = {}
        self._inputs: dict[str, InputPosition] = {}
        for key, value in trackables.items():
            if key.startswith("__") or key == SAVE_COUNTER:
                raise InvalidArgumentError(
                    f"Checkpoint: {SAVE_COUNTER!r} and names starting with '__' are reserved; got {key!r}"
                )
            for path, leaf in nest.flatten_with_paths(value):
                name = "/".join([key, *map(str, path)])
                if isinstance(leaf, Variable):
                    self._variables[name] = leaf
                elif isinstance(leaf, Optimizer):
                    self._optimizers[name] = leaf
                elif (position := input_position(leaf)) is not None:
                    self._inputs[name] = position
                else:
                    raise InvalidArgumentError(
                        f"Checkpoint: {name} must be a Variable, an optimizer, a distributed dataset or "
                        f"iterator, or a nest of them; got {type(leaf).__name__}"
                    )
        # Plain on every rank: saves and restores are collective, so every rank holds the same count.
        self._save_counter = Variable._plain(np.zeros((), np.int64), SAVE_COUNTER, False)

    @property
    def save_counter(self) -> Variable:
        """How many times :meth:`save` has run (restored with the checkpoint): it numbers the files."""
        return self._save_counter

    # -- what is saved --------------------------------------------------------------------

    def _entries(self) -> dict[str, Any]:
        """Every entry (a variable, a sharded optimizer's slot, an input's position), in name order
        (the same on every rank)."""
        entries: dict[str, Any] = {**self._variables, **self._inputs}
        names = {id(v): n for n, v in self._variables.items()}
        for opt_name, opt in self._optimizers.items():
            entries[f"{opt_name}/iterations"] = opt.iterations
            for var, slots in opt._slots.values():
                if id(var) not in names:
                    raise InvalidArgumentError(
                        f"Checkpoint: optimizer {opt_name!r} has slots for variable {var.name!r}, which this "
                        "checkpoint does not track; pass that variable to Checkpoint(...) too"
                    )
                for slot_name, slot in slots.items():
                    entries[f"{opt_name}/slots/{names[id(var)]}/{slot_name}"] = slot
        return dict(sorted(entries.items()))

    def _build_slots(self, names: list[str]) -> None:
        """Create the optimizer slots a checkpoint holds for tracked variables (collective)."""
        for opt_name, opt in self._optimizers.items():
            prefix = f"{opt_name}/slots/"
            wanted = {n[len(prefix) :].rsplit("/", 1)[0] for n in names if n.startswith(prefix)}
            opt.build([self._variables[w] for w in sorted(wanted) if w in self._variables])

    def _strategy(self, method: str) -> Any:
        """The strategy whose ranks take part: the tracked variables' (all one), else the current one."""
        owners = {id(s): s for v in self._variables.values() if (s := v.distribute_strategy) is not None}
        owners.update((id(p.strategy), p.strategy) for p in self._inputs.values())
        if len(owners) > 1:
            raise InvalidArgumentError(
                f"Checkpoint.{method}: the tracked variables and inputs belong to different strategies"
            )
        mode = context.current_mode()
        strategy = next(iter(owners.values())) if owners else mode.strategy
        if mode.kind in ("replica", "merge"):
            raise ContextError(
                f"Checkpoint.{method} is collective: call it on every rank in cross-replica context "
                "(outside strategy.run and merge_fn)"
            )
        if mode.kind != "default" and mode.strategy is not strategy:
            raise ContextError(
                f"Checkpoint.{method}: the variables belong to {strategy}, not to {mode.strategy}"
            )
        return strategy

    # -- save / write / restore / read -------------------------------------------------------

    def save(self, file_prefix: str | os.PathLike[str]) -> str:
        """Write a numbered checkpoint ``<file_prefix>-<n>`` (collective); returns its path.

        ``n`` is ``save_counter + 1``, and ``save_counter`` becomes ``n`` once the file is
        written. The directory's index then names this file as the latest, for
        :func:`latest_checkpoint` (use :class:`CheckpointManager` to keep several).
        """
        number = int(self._save_counter.numpy()) + 1
        path = f"{os.fspath(file_prefix)}-{number}"
        directory = os.path.dirname(path) or "."
        self._write_file(path, "save", number, lambda: _write_index(directory, [os.path.basename(path)]))
        self._save_counter.assign(np.int64(number))
        return path

    def write(self, file_path: str | os.PathLike[str]) -> str:
        """Write a checkpoint to exactly ``file_path`` (collective); returns it.

        Unnumbered, and not recorded in the directory's index; read it back with :meth:`read`.
        """
        path = os.fspath(file_path)
        if os.path.basename(path) == INDEX:
            raise InvalidArgumentError(
                f"Checkpoint.write: {INDEX!r} is the index file's name; pick another name"
            )
        return self._write_file(path, "write", int(self._save_counter.numpy()))

    def _write_file(
        self, path: str, method: str, counter: int, after: Callable[[], None] | None = None
    ) -> str:
        """Rank 0 writes every entry to ``path`` atomically, then runs ``after`` (the index's update).

        Entries travel one at a time: a sharded slot is assembled from its parts (one
        all-gather of that variable), written, and dropped before the next, so no rank ever
        holds more than one variable beyond its own state.
        """
        strategy = self._strategy(method)
        collectives = strategy.extended.collectives
        entries = self._entries()
        described = [(n, str(v.dtype), v.shape) for n, v in entries.items()]
        collectives.agree(
            "checkpoint.save", fingerprint=code(repr(described)), describe=lambda: {"leaves": described}
        )
        # Gathered before the file opens: ranks at different positions fail the save, leaving nothing behind.
        positions = {n: v.value() for n, v in entries.items() if isinstance(v, InputPosition)}
        archive = _Archive(path) if collectives.rank == 0 else None
        for name, var in entries.items():
            # Collective for sync-on-read variables (aggregated) and sharded slots.
            value = positions[name] if name in positions else var.value()
            if archive is not None:
                archive.add(name, value)
            del value
        if archive is not None:
            archive.add(SAVE_COUNTER, np.array(counter, np.int64))
            meta = {"format": _FORMAT, "num_replicas": strategy.num_replicas_in_sync}
            archive.add(_META, np.array(json.dumps(meta)))
        collectives.on_root(lambda: _commit(archive, after), kind=f"checkpoint.{method} (write)")
        return path

    def restore(self, save_path: str | os.PathLike[str] | None) -> CheckpointLoadStatus:
        """Load ``save_path`` into the tracked objects (collective); returns a status.

        Lenient, as tf's: entries the file lacks keep their values, and entries of the file
        that nothing here tracks are skipped (a warning names them unless the status's
        ``expect_partial()`` is called); ``status.assert_consumed()`` makes either an error.
        Entries whose shape or dtype differ are an error naming them; nothing is assigned
        then. ``save_counter`` is restored too. ``None`` (nothing saved yet) restores nothing.
        """
        strategy = self._strategy("restore")
        # Collective even for None, so a rank that found no checkpoint fails every rank instead of hanging.
        strategy.extended.collectives.agree(
            "checkpoint.restore",
            fingerprint=int(save_path is None),
            describe=lambda: {"leaves": [("save_path", "None" if save_path is None else "a path", ())]},
        )
        if save_path is None:
            return CheckpointLoadStatus(None, [], [])
        return self._load(os.fspath(save_path), "restore", strategy)

    def read(self, save_path: str | os.PathLike[str]) -> CheckpointLoadStatus:
        """Load a file written by :meth:`write` (collective); as :meth:`restore`, but ``None`` is an error."""
        if save_path is None:
            raise InvalidArgumentError("Checkpoint.read: save_path must be a path; got None")
        strategy = self._strategy("read")
        strategy.extended.collectives.agree("checkpoint.restore")
        return self._load(os.fspath(save_path), "read", strategy)

    def _load(self, path: str, method: str, strategy: Any) -> CheckpointLoadStatus:
        """Rank 0 checks the file and reads what it holds; then each entry travels alone (one
        broadcast), so no rank holds more than one variable beyond its own state."""
        collectives = strategy.extended.collectives
        index, counter = collectives.on_root(lambda: _read_index(path), kind=f"checkpoint.{method} (read)")
        if index is None:
            raise InvalidArgumentError(f"Checkpoint.{method}: {path} is not an mpistrat checkpoint")
        self._build_slots(sorted(index))
        entries = self._entries()
        _check_shapes(f"Checkpoint.{method}({path!r})", entries, index)
        reader = _Reader(path) if collectives.rank == 0 else None
        try:
            with strategy.extended.writes_in_sync():  # every rank assigns rank 0's broadcast values
                for name, var in entries.items():
                    if name in index:
                        dtype, shape = index[name]
                        value, error = np.empty(shape, dtype), None
                        if reader is not None:
                            value, error = reader.get(name, value)
                        var.assign(
                            collectives.broadcast(value, kind=f"checkpoint.{method} ({name})", error=error)
                        )
        finally:
            if reader is not None:
                reader.close()
        if counter is not None:
            self._save_counter.assign(np.int64(counter))
        missing = [n for n in entries if n not in index]
        return CheckpointLoadStatus(path, missing, [n for n in index if n not in entries])


class CheckpointLoadStatus:
    """What :meth:`Checkpoint.restore` matched, as tf's load status (the same on every rank).

    ``assert_consumed()`` raises ``AssertionError`` unless every entry of the file was
    restored into a tracked object and every tracked object got a value;
    ``assert_existing_objects_matched()`` only checks the second. ``expect_partial()``
    silences the warning about unused entries. Each returns the status.
    """

    def __init__(self, path: str | None, missing: list[str], unused: list[str]):
        self._path, self._missing, self._unused = path, missing, unused
        self._silenced = [False]  # shared with the finalizer, which must not hold the status
        if unused:
            weakref.finalize(self, _warn_unused, path, unused, self._silenced)

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Every entry of the file restored, every tracked object matched; else ``AssertionError``."""
        self.assert_existing_objects_matched()
        if self._unused:
            raise AssertionError(
                f"Checkpoint.restore({self._path!r}): values in the checkpoint that nothing here tracks: "
                f"{', '.join(self._unused)}"
            )
        return self

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Every tracked object got a value from the file; else ``AssertionError`` naming the others."""
        if self._path is None:
            raise AssertionError("No checkpoint specified (save_path=None); nothing is being restored.")
        if self._missing:
            raise AssertionError(
                f"Checkpoint.restore({self._path!r}): tracked objects with no value in the checkpoint "
                f"(they keep their values): {', '.join(self._missing)}"
            )
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Say that a partial restore is intended: no warning about unused entries."""
        self._silenced[0] = True
        return self


def _warn_unused(path: str | None, unused: list[str], silenced: list[bool]) -> None:
    if not silenced[0]:
        logger.warning(
            "Checkpoint.restore(%r): values in the checkpoint that nothing here tracks were not restored: %s "
            "(call expect_partial() on the status restore returns to silence this)",
            path,
            ", ".join(unused),
        )


def _check_shapes(
    what: str, entries: dict[str, Any], index: dict[str, tuple[np.dtype, tuple[int, ...]]]
) -> None:
    mismatched = [
        f"{n} ({v.mismatch(*index[n])})"
        if isinstance(v, InputPosition)
        else f"{n} (checkpoint: {index[n][0]}{list(index[n][1])}, here: {v.dtype}{list(v.shape)})"
        for n, v in entries.items()
        if n in index and (tuple(index[n][1]) != tuple(v.shape) or index[n][0] != v.dtype)
    ]
    if mismatched:
        raise InvalidArgumentError(f"{what}: different shape or dtype: {'; '.join(mismatched)}")


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The path of the newest checkpoint saved in ``directory``, or None, as ``tf.train.latest_checkpoint``.

    Read from the directory's index file. If that file exists but is unreadable
    (truncated, corrupt) or names a file that is gone, a warning says so and the
    newest valid mpistrat checkpoint file in ``directory`` (by modification time)
    is returned instead; None if there is none. No index file: None.

    Collective over the current strategy: in ``strategy.scope()`` rank 0 reads and every
    rank gets its answer; outside any scope each rank reads for itself.
    """
    mode = context.current_mode()
    if mode.kind in ("replica", "merge"):
        raise ContextError(
            "latest_checkpoint is collective: call it on every rank in cross-replica context "
            "(outside strategy.run and merge_fn)"
        )
    collectives = mode.strategy.extended.collectives
    collectives.agree("checkpoint.latest")
    return collectives.on_root(lambda: _find_latest(os.fspath(directory)), kind="checkpoint.latest (read)")


def _write_atomic(path: str, content: str) -> None:
    """Write ``content`` to a temporary file in the same directory, fsync it, rename it over ``path``."""
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as f:
            f.write(content.encode())
        _replace_durably(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _temporary(path: str) -> str:
    """The temporary file a write of ``path`` goes to (its directory made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return f"{path}.tmp{os.getpid()}-{_host()}"


def _replace_durably(tmp: str, path: str) -> None:
    """fsync the finished ``tmp``, rename it over ``path`` and make the rename itself durable."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    _before_rename(tmp, path)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Archive:
    """Rank 0's checkpoint file in the making: ``.npz`` members (as ``np.savez`` writes them, no
    pickles) added one at a time to a temporary file. The first error is kept, not raised: the
    other ranks are in the same loop of collectives, and :func:`_commit` raises it on every rank."""

    def __init__(self, path: str):
        self.path, self.error = path, None
        self.tmp = ""
        self.zip: zipfile.ZipFile | None = None
        try:
            _remove_stale_temporaries(os.path.dirname(path) or ".")
            self.tmp = _temporary(path)
            self.zip = zipfile.ZipFile(self.tmp, "w", zipfile.ZIP_STORED, allowZip64=True)
        except BaseException as exc:
            self.error = exc

    def add(self, name: str, value: Any) -> None:
        """Append ``value`` (a NumPy or device array) as member ``name``."""
        if self.error is not None or self.zip is None:
            return
        try:
            array = _to_numpy(value)  # a device-to-host copy may fail too: kept like a write error
            with self.zip.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)
        except BaseException as exc:
            self.error = exc

    def close(self) -> None:
        if self.zip is not None:
            zip_, self.zip = self.zip, None
            zip_.close()


def _commit(archive: _Archive | None, after: Callable[[], None] | None) -> None:
    """Finish rank 0's archive and rename it into place, then run ``after``; or raise its error."""
    assert archive is not None  # run on rank 0 alone
    try:
        if archive.error is not None:
            raise archive.error
        archive.close()
        _replace_durably(archive.tmp, archive.path)
    except BaseException:
        with contextlib.suppress(Exception):
            archive.close()
        with contextlib.suppress(OSError):
            if archive.tmp:
                os.remove(archive.tmp)
        raise
    if after is not None:
        after()


# -- faults: corrupt files, unreadable indexes, abandoned temporaries ---------------------------

# What a truncated or corrupt .npz raises while being read, depending on where the damage is.
# (NotImplementedError and RuntimeError: zipfile's answer to a damaged compression method or flags.)
_CORRUPT = (
    zipfile.BadZipFile,
    zlib.error,
    ValueError,
    EOFError,
    KeyError,
    OSError,
    NotImplementedError,
    RuntimeError,
)


def _read_index(path: str) -> tuple[dict[str, tuple[np.dtype, tuple[int, ...]]] | None, Any]:
    """What the checkpoint file ``path`` holds: ``{entry: (dtype, shape)}`` and its save counter
    (None if absent); the index is None for a file that is not an mpistrat checkpoint. On rank 0.

    Every member's CRC is checked first (reading the file through once, in small pieces), so a
    truncated or corrupt file raises ``InvalidArgumentError`` naming it before anything is
    restored. A missing or unopenable file raises what ``open`` raises.
    """
    with open(path, "rb") as f:
        try:
            with zipfile.ZipFile(f) as archive:
                bad = archive.testzip()
                if bad is not None:
                    raise zipfile.BadZipFile(f"member {bad} fails its CRC check")
                index: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
                for info in archive.infolist():
                    with archive.open(info) as member:
                        shape, dtype = _header(member)
                    index[info.filename.removesuffix(".npy")] = (dtype, tuple(shape))
                if _META not in index:
                    return None, None
                small = {k: _member(archive, k) for k in (_META, SAVE_COUNTER) if k in index}
            meta = json.loads(str(small[_META]))
            if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
                raise ValueError(f"unknown format {meta!r}")
        except _CORRUPT as exc:
            raise InvalidArgumentError(
                f"Checkpoint.restore: {path} is truncated or corrupt and cannot be read "
                f"({type(exc).__name__}: {exc})"
            ) from exc
    counter = small.get(SAVE_COUNTER)
    index.pop(_META)
    index.pop(SAVE_COUNTER, None)
    return index, None if counter is None else int(counter)


def _header(member: Any) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype an ``.npy`` member's header gives, read without its data."""
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(member)
    elif version == (2, 0):
        shape, _, dtype = np.lib.format.read_array_header_2_0(member)
    else:
        raise ValueError(f"unsupported .npy format version {version}")
    return shape, dtype


def _member(archive: zipfile.ZipFile, name: str) -> np.ndarray:
    with archive.open(f"{name}.npy") as member:
        return np.lib.format.read_array(member, allow_pickle=False)


class _Reader:
    """Rank 0's open checkpoint file, read one entry at a time (after :func:`_read_index`)."""

    def __init__(self, path: str):
        self.path = path
        self.archive: zipfile.ZipFile | None = None
        self.error: InvalidArgumentError | None = None
        try:
            self.archive = zipfile.ZipFile(path)
        except (OSError, *_CORRUPT) as exc:
            self.error = self._failed(exc)

    def _failed(self, exc: BaseException) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"Checkpoint.restore: {self.path} could not be read ({type(exc).__name__}: {exc}); "
            "was it changed while being restored?"
        )

    def get(self, name: str, placeholder: np.ndarray) -> tuple[np.ndarray, InvalidArgumentError | None]:
        """Entry ``name``, or ``placeholder`` and the error to raise on every rank."""
        if self.error is not None or self.archive is None:
            return placeholder, self.error or self._failed(RuntimeError("not open"))
        try:
            value = _member(self.archive, name)
        except (OSError, *_CORRUPT) as exc:
            self.error = self._failed(exc)
            return placeholder, self.error
        if value.shape != placeholder.shape or value.dtype != placeholder.dtype:
            self.error = self._failed(ValueError(f"{name} is not what its header said"))
            return placeholder, self.error
        return value, None

    def close(self) -> None:
        if self.archive is not None:
            self.archive.close()


def _is_valid(path: str) -> bool:
    """Whether ``path`` is a complete mpistrat checkpoint file (every member's CRC checked)."""
    try:
        with zipfile.ZipFile(path) as archive:
            if f"{_META}.npy" not in archive.namelist():
                return False
        return _read_index(path)[0] is not None
    except (InvalidArgumentError, *_CORRUPT):
        return False


def _write_index(directory: str, names: list[str]) -> None:
    """Record checkpoint file names (oldest first; the last is the latest) in the directory's index."""
    _write_atomic(os.path.join(directory, INDEX), json.dumps({"latest": names[-1], "all": names}))


def _find_latest(directory: str) -> str | None:
    return _checkpoint_state(directory)[0]


def _checkpoint_state(directory: str) -> tuple[str | None, list[str]]:
    """The latest checkpoint's path and every recorded one (oldest first), from the directory's index.

    No index: ``(None, [])``. An unreadable index, or one naming a file that is gone: a
    warning, and the newest valid checkpoint file in ``directory`` as the only one.
    """
    index = os.path.join(directory, INDEX)
    try:
        with open(index, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, []  # nothing was ever saved here
    except OSError as exc:
        problem = f"cannot be read ({type(exc).__name__}: {exc})"
    else:
        try:
            state = json.loads(raw.decode())
            names = state.get("all", [state["latest"]])  # files of older versions hold only "latest"
            if not isinstance(names, list) or not all(isinstance(n, str) for n in [state["latest"], *names]):
                raise TypeError(f"expected names of files; got {state!r}")
            candidate = os.path.join(directory, os.path.basename(state["latest"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            problem = f"is truncated or corrupt ({type(exc).__name__}: {exc})"
        else:
            if os.path.isfile(candidate):
                return candidate, [os.path.join(directory, os.path.basename(n)) for n in names]
            problem = f"names {candidate}, which does not exist"
    fallback = _newest_valid(directory)
    logger.warning(
        "latest_checkpoint: the index %s %s; using the newest valid checkpoint in %s instead: %s",
        index,
        problem,
        directory,
        fallback,
    )
    return fallback, [] if fallback is None else [fallback]


def _newest_valid(directory: str) -> str | None:
    """The most recently modified valid checkpoint file in ``directory``, or None."""
    candidates = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if entry.name == INDEX or _TMP_NAME.match(entry.name):
                continue
            with contextlib.suppress(OSError):
                if entry.is_file():
                    candidates.append((entry.stat().st_mtime, entry.name))
    for _, name in sorted(candidates, reverse=True):
        if _is_valid(os.path.join(directory, name)):
            return os.path.join(directory, name)
    return None


def _host() -> str:
    """This host's name as it appears in temporary files' names."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "localhost"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists, as another user's process
        return True
    except (OverflowError, ValueError):  # not a process id at all: the name only looks like ours
        return True
    return True


def _stale_temporaries(directory: str, now: float | None = None) -> list[str]:
    """Temporary files in ``directory`` that a killed save abandoned and no save still writes.

    A file is one of ours if its name is ``<name>.tmp<pid>-<host>`` (or ``<name>.tmp<pid>``)
    and it starts like an ``.npz`` or the index; anything else is never touched. One of
    ours is stale if it names this host and a PID that is not alive here (and not this
    process), or if it was last modified more than ``_STALE_AFTER`` seconds ago (another
    host's save, a reused PID, an old-style name). A concurrent save by another job thus
    keeps its temporary: its process is alive, or it is on another host and recent.
    """
    now = time.time() if now is None else now
    host, stale = _host(), []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        match = _TMP_NAME.match(entry.name)
        if not match:
            continue
        with contextlib.suppress(OSError):
            if not entry.is_file(follow_symlinks=False):
                continue
            pid = int(match["pid"])
            dead_here = match["host"] == host and pid != os.getpid() and not _pid_alive(pid)
            if not dead_here and now - entry.stat(follow_symlinks=False).st_mtime <= _STALE_AFTER:
                continue
            with open(entry.path, "rb") as f:
                start = f.read(16)
            if start.startswith(_TMP_STARTS):
                stale.append(entry.path)
    return sorted(stale)


def _remove_stale_temporaries(directory: str) -> None:
    """Remove :func:`_stale_temporaries` (on rank 0, before a save); never fails the save."""
    removed, size = 0, 0
    for path in _stale_temporaries(directory):
        with contextlib.suppress(OSError):
            nbytes = os.path.getsize(path)
            os.remove(path)
            removed, size = removed + 1, size + nbytes
    if removed:
        logger.info(
            "Checkpoint.save: removed %d temporary file(s) of killed saves in %s (%.1f MiB)",
            removed,
            directory,
            size / 2**20,
        )
