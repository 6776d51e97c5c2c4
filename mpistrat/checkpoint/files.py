"""A checkpoint directory's files: the index, temporary names, atomic renames, killed saves' leftovers.

A directory's :data:`INDEX` file (``checkpoint``) holds ``{"latest": name, "all": [names, oldest
first]}``. Every file is written to ``<path>.tmp<pid>-<host>``, ``fsync``-ed and renamed over
``path``, so the previous file stays intact until the new one is complete.

Faults it handles: before a save, rank 0 removes the temporary files that killed saves left
in its directory (see :func:`_stale_temporaries`); :func:`checkpoint_state` falls back to the
newest valid checkpoint file when the index is unreadable, with a warning. What a checkpoint
file holds is :mod:`mpistrat.checkpoint.format`'s; who writes which bytes,
:mod:`mpistrat.checkpoint.saving`'s.

>>> import os, tempfile
>>> directory = tempfile.mkdtemp()
>>> write_index(directory, ["ckpt-1", "ckpt-2"])
>>> open(os.path.join(directory, INDEX)).read()
'{"latest": "ckpt-2", "all": ["ckpt-1", "ckpt-2"]}'
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import stat
import threading
import time
from typing import IO

from mpistrat.checkpoint import format, legacy
from mpistrat.checkpoint.format import Table
from mpistrat.errors import InvalidArgumentError
from mpistrat.log import logger

__all__ = [
    "INDEX",
    "Listing",
    "checkpoint_state",
    "is_valid",
    "open_regular",
    "read_table",
    "record",
    "remove_stale_temporaries",
    "replace_durably",
    "temporary",
    "wait_for_removals",
    "write_index",
]

INDEX = "checkpoint"  # in a checkpoint's directory: names the latest one

# Temporary files are named ``<path>.tmp<pid>-<host>``, the host's name holding a letter (a
# checkpoint a save numbers, ``exp.tmp2025-1``, is thus never taken for one). A later save in the
# same directory removes one when it is certainly abandoned: written on this host by a process
# that is no longer alive, or (another host, a reused PID) last modified more than _STALE_AFTER
# seconds ago.
_TMP_NAME = re.compile(r"^(?P<target>.+)\.tmp(?P<pid>[0-9]+)-(?P<host>[\w.-]*[A-Za-z][\w.-]*)$", re.ASCII)
_STALE_AFTER = 3600.0
# Only files that start like what a save writes: an .npz (format 1, a zip), the index's JSON, or
# format 2 (safetensors: an 8-byte length, then the JSON header's '{').
_TMP_STARTS = (b"PK\x03\x04", b'{"latest"')


def _before_rename(tmp: str, path: str) -> None:
    """Called between writing the temporary file and renaming it (a seam for tests)."""


# -- atomic files -------------------------------------------------------------------------------


def _write_atomic(path: str, content: str) -> None:
    """Write ``content`` to a temporary file in the same directory, fsync it, rename it over ``path``."""
    tmp = temporary(path)
    try:
        with open(tmp, "wb") as f:
            f.write(content.encode())
        replace_durably(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def temporary(path: str) -> str:
    """The temporary file a write of ``path`` goes to (its directory made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return f"{path}.tmp{os.getpid()}-{_host()}"


def replace_durably(tmp: str, path: str) -> None:
    """fsync the finished ``tmp``, rename it over ``path`` and make the rename itself durable.

    The file replaced keeps a second name (a temporary's) until the rename is durable, so the
    folder's fsync frees none of its blocks: a file system that discards freed blocks as it commits
    (ext4 with ``discard``: 35-40 ms for 192 MiB) does so at a later commit, after the save returns.
    That name is then removed, in a thread when the file is :data:`_REMOVED_BESIDE` bytes or more:
    the kernel drops its cached pages as it goes (33 ms for 192 MiB), which no save waits for.
    """
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    _before_rename(tmp, path)
    previous = _second_name(path)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if previous is not None:
        _remove(previous)


# From this size a replaced file's last name is removed beside the training (see replace_durably),
# by a thread of this name.
_REMOVED_BESIDE = 16 << 20
_REMOVER = "mpistrat-remove"


def _remove(name: str) -> None:
    """Remove ``name`` (a file's second name), in a thread if it is large; an error changes nothing
    (a name left behind is removed by a later save as a killed save's temporary)."""
    try:
        large = os.stat(name, follow_symlinks=False).st_size >= _REMOVED_BESIDE
    except OSError:
        return
    if large:  # not a daemon: the interpreter waits for it at exit
        threading.Thread(target=_remove_quietly, args=(name,), name=_REMOVER).start()
    else:
        _remove_quietly(name)


def wait_for_removals() -> None:
    """Return once the replaced files this process is removing are gone (a benchmark's pause)."""
    for thread in threading.enumerate():
        if thread.name == _REMOVER:
            thread.join()


def _remove_quietly(name: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(name)


def _second_name(path: str) -> str | None:
    """A hard link to the file at ``path`` named as a temporary (a killed save's is removed as one),
    or None: no file there, or a file system without hard links."""
    name = temporary(path + ".replaced")
    try:
        os.link(path, name, follow_symlinks=False)
    except OSError:
        return None
    return name


def read_table(path: str) -> Table | None:
    """What the checkpoint file ``path`` holds, checked (see :func:`format.read_table`); None for
    a file that is not an mpistrat checkpoint. Format-1 files (``.npz``, a zip) are read by
    :mod:`~mpistrat.checkpoint.legacy`. A missing file raises what ``open`` raises, anything but a
    regular file (a FIFO, a device, a directory) ``InvalidArgumentError``. On one rank (rank 0
    reads it for all)."""
    with open_regular(path, "Checkpoint.restore") as f:
        if f.read(2) == b"PK":
            return legacy.read_table(path, f)
        return format.read_table(path, f)


def open_regular(path: str, where: str) -> IO[bytes]:
    """``path`` open for reading if it is a regular file; else ``InvalidArgumentError`` saying what
    it is (a FIFO would block the open until a writer came, a device never end)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, writer or not
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kinds = [(stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a device")]
            kind = next((name for test, name in kinds if test(mode)), "not a file")
            raise InvalidArgumentError(f"{where}: {path} is {kind}, not a regular file: a checkpoint is one")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def is_valid(path: str) -> bool:
    """Whether ``path`` is a complete mpistrat checkpoint file: its header checks out and the
    file holds every byte it lists (the data's checksums are checked when it is restored)."""
    try:
        return read_table(path) is not None
    except (InvalidArgumentError, OSError):
        return False


# -- the index: which checkpoints a directory holds ----------------------------------------------


def write_index(directory: str, names: list[str]) -> None:
    """Record checkpoint file names (oldest first; the last is the latest) in the directory's index."""
    _write_atomic(os.path.join(directory, INDEX), json.dumps({"latest": names[-1], "all": names}))


@dataclasses.dataclass(frozen=True)
class Listing:
    """What a save records in ``directory``'s index once its file is in place: the checkpoints
    ``kept`` (paths, oldest first; the last is the new one), after deleting those ``dropped``
    (the oldest beyond a manager's ``max_to_keep``)."""

    directory: str
    kept: list[str]
    dropped: list[str] = dataclasses.field(default_factory=list)


def record(listing: Listing) -> None:
    """On rank 0, once the new file is in place: the index names it before anything is deleted (a
    job killed while deleting still finds it), then once more without the deleted files. A large
    deleted file's blocks and pages are freed in a thread (see :func:`replace_durably`)."""
    write_index(listing.directory, [os.path.basename(p) for p in [*listing.dropped, *listing.kept]])
    if listing.dropped:
        for old in listing.dropped:
            second = _second_name(old)  # freed beside the training, as a replaced file
            with contextlib.suppress(FileNotFoundError):
                os.remove(old)
            if second is not None:
                _remove(second)
        write_index(listing.directory, [os.path.basename(p) for p in listing.kept])


def checkpoint_state(directory: str) -> tuple[str | None, list[str]]:
    """The latest checkpoint's path and every recorded one (oldest first), from the directory's index.

    No index: ``(None, [])``. An unreadable index, or one naming a file that is gone: a
    warning, and the newest valid checkpoint file in ``directory`` as the only one.
    """
    index = os.path.join(directory, INDEX)
    try:
        with open_regular(index, "latest_checkpoint") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, []  # nothing was ever saved here
    except (OSError, InvalidArgumentError) as exc:
        problem = f"cannot be read ({type(exc).__name__}: {exc})"
    else:
        try:
            state = json.loads(raw.decode())
            names = state.get("all", [state["latest"]])  # files of older versions hold only "latest"
            if not isinstance(names, list) or not all(isinstance(n, str) for n in [state["latest"], *names]):
                raise TypeError(f"expected names of files; got {state!r}")
            candidate = os.path.join(directory, os.path.basename(state["latest"]))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
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
        if is_valid(os.path.join(directory, name)):
            return os.path.join(directory, name)
    return None


# -- temporaries that killed saves left behind -----------------------------------------------------


def _host() -> str:
    """This host's name as it appears in temporary files' names (with a letter: ``host`` leads a
    name without one, such as an address)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())
    return name if re.search("[A-Za-z]", name) else f"host{name}"


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

    A file is one of ours if its name is ``<name>.tmp<pid>-<host>`` (the host's name holding a
    letter), the directory's index does not list it, and it starts like a checkpoint or the
    index; anything else is never touched. One of ours is stale if it names this host and a
    PID that is not alive here (and not this process), or if it was last modified more than
    ``_STALE_AFTER`` seconds ago (another host's save, a reused PID). A concurrent save by
    another job thus keeps its temporary: its process is alive, or it is on another host and
    recent.
    """
    now = time.time() if now is None else now
    host, stale = _host(), []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    listed = _listed(directory)
    for entry in entries:
        match = _TMP_NAME.match(entry.name)
        if not match or entry.name in listed:
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
            if start.startswith(_TMP_STARTS) or start[8:9] == b"{":
                stale.append(entry.path)
    return sorted(stale)


def _listed(directory: str) -> set[str]:
    """The names the directory's index lists (none when it has no readable index)."""
    try:
        with open_regular(os.path.join(directory, INDEX), "Checkpoint.save") as f:
            state = json.loads(f.read().decode())
        return {n for n in [state["latest"], *state.get("all", [])] if isinstance(n, str)}
    except (
        OSError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        RecursionError,
    ):  # InvalidArgumentError too
        return set()


def remove_stale_temporaries(directory: str) -> None:
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
