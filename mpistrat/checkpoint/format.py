"""The on-disk format of a checkpoint: what is written where, atomically, and how it is read back.

A checkpoint is one ``.npz`` file (a zip, stored uncompressed, ZIP64): one ``.npy`` member per
entry, named by the entry (``model/w.npy``), then :data:`SAVE_COUNTER` and ``__mpistrat__``, a
JSON string ``{"format": 1, "num_replicas": R}`` that marks the file as ours. A directory's
:data:`INDEX` file (``checkpoint``) holds ``{"latest": name, "all": [names, oldest first]}``.
Every file is written to ``<path>.tmp<pid>-<host>``, ``fsync``-ed and renamed over ``path``, so
the previous file stays intact until the new one is complete.

Faults it handles: a new :class:`Archive` first removes the temporary files that killed saves
left in its directory (see :func:`_stale_temporaries`); :func:`checkpoint_state` falls back to the newest
valid checkpoint file when the index is unreadable, with a warning; and :func:`read_index` of a
truncated or corrupt file raises ``InvalidArgumentError`` naming the file. What runs where
(rank 0 writes and reads, the ranks agree) is :mod:`mpistrat.checkpoint.checkpoint`'s job.

>>> import os, tempfile
>>> directory = tempfile.mkdtemp()
>>> write_index(directory, ["ckpt-1", "ckpt-2"])
>>> open(os.path.join(directory, INDEX)).read()
'{"latest": "ckpt-2", "all": ["ckpt-1", "ckpt-2"]}'
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from mpistrat.errors import InvalidArgumentError
from mpistrat.log import logger
from mpistrat.training.variables import to_numpy

__all__ = [
    "INDEX",
    "SAVE_COUNTER",
    "Archive",
    "Index",
    "Reader",
    "checkpoint_state",
    "commit",
    "read_index",
    "write_index",
]

Index = dict[str, tuple[np.dtype, tuple[int, ...]]]  # {entry: (dtype, shape)}, as a file's headers say

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


# -- writing: atomic files, the checkpoint file ------------------------------------------------


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


class Archive:
    """Rank 0's checkpoint file in the making: ``.npz`` members (as ``np.savez`` writes them, no
    pickles) added one at a time to a temporary file. The first error is kept, not raised: the
    other ranks are in the same loop of collectives, and :func:`commit` raises it on every rank."""

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
            array = to_numpy(value)  # a device-to-host copy may fail too: kept like a write error
            with self.zip.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)
        except BaseException as exc:
            self.error = exc

    def finish(self, counter: int, num_replicas: int) -> None:
        """Append the save counter and the mark that makes the file a checkpoint: the last members."""
        self.add(SAVE_COUNTER, np.array(counter, np.int64))
        self.add(_META, np.array(json.dumps({"format": _FORMAT, "num_replicas": num_replicas})))

    def close(self) -> None:
        if self.zip is not None:
            zip_, self.zip = self.zip, None
            zip_.close()


def commit(archive: Archive | None, after: Callable[[], None] | None) -> None:
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


# -- reading: a checkpoint file, checked before anything is restored ----------------------------

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


def read_index(path: str) -> tuple[Index | None, Any]:
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
                index: Index = {}
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


class Reader:
    """Rank 0's open checkpoint file, read one entry at a time (after :func:`read_index`)."""

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
        return read_index(path)[0] is not None
    except (InvalidArgumentError, *_CORRUPT):
        return False


# -- the index: which checkpoints a directory holds ----------------------------------------------


def write_index(directory: str, names: list[str]) -> None:
    """Record checkpoint file names (oldest first; the last is the latest) in the directory's index."""
    _write_atomic(os.path.join(directory, INDEX), json.dumps({"latest": names[-1], "all": names}))


def checkpoint_state(directory: str) -> tuple[str | None, list[str]]:
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


# -- temporaries that killed saves left behind -----------------------------------------------------


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
