"""The timeline: each rank writes its collectives and the program's spans as trace events.

Turned on by ``MPISTRAT_TIMELINE=DIR`` (read when a strategy is created) or
:func:`start_timeline`. Each rank then writes ``DIR/rank-NNNNN.jsonl``: a header line,
then one JSON object per event, times in seconds of this rank's monotonic clock:

* a ``collective`` (``all_reduce``, ``merge_call``, ...): sequence number, call site,
  bytes of its arguments, time in its handshake(s) and time transferring;
* a ``handshake``: when this rank entered and left it. Every rank leaves a handshake
  within microseconds of the others (it is an all-reduce), which is what
  ``mpistrat timeline DIR -o trace.json`` aligns the ranks' clocks on; how long each rank
  waited in it says who arrived late;
* a ``span`` of the program's own: ``with mpistrat.trace("forward"): ...``.

Events are buffered and written every few thousand, when the timeline stops, and at
exit. Off, :func:`trace` returns a shared do-nothing context and the collectives test
one module attribute.

>>> with trace("forward"):  # the timeline is off here: nothing is recorded
...     pass
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import threading
import time
from typing import Any

from mpi4py import MPI

from mpistrat import nest
from mpistrat.diagnostics.callsite import cached_call_site as _site
from mpistrat.errors import InvalidArgumentError
from mpistrat.log import ANY_RANK, logger

__all__ = ["Writer", "start_timeline", "stop_timeline", "trace", "writer"]

FLUSH_EVERY = 4096  # events buffered before a write
FORMAT = "mpistrat-timeline-1"

writer: Writer | None = None  # the active timeline of this process; None: off
_members: dict[tuple[int, ...], itertools.count[int]] = {}
_exit_registered = False


def _world_rank() -> tuple[int, int]:
    if MPI.Is_initialized() and not MPI.Is_finalized():
        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    return 0, 1


class Writer:
    """One rank's timeline file: events buffered, written in batches."""

    def __init__(self, directory: str):
        self.rank, self.size = _world_rank()
        self.directory = directory
        try:
            os.makedirs(directory, exist_ok=True)
            self.path = os.path.join(directory, f"rank-{self.rank:05d}.jsonl")
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 (closed by stop_timeline)
            import json  # here, not at import: most jobs write no timeline

            self._file.write(json.dumps(self._header()) + "\n")
            self._file.flush()
        except OSError as exc:
            raise InvalidArgumentError(f"cannot write the timeline in {directory!r}: {exc}") from None
        self._events: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        self._main = threading.main_thread().ident
        self.pending_handshake = 0.0  # seconds in handshakes since the current collective began
        self.pending_site: str | None = None

    def _header(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "rank": self.rank,
            "size": self.size,
            "host": os.uname().nodename,
            "pid": os.getpid(),
            "clock": "monotonic",
            "started": time.monotonic(),
        }

    def add(self, cat: str, name: str, began: float, ended: float, args: tuple[Any, ...] = ()) -> None:
        """One event; kept as a tuple until written (this runs per collective). ``args``: see ``_line``."""
        ident = threading.get_ident()
        with self._lock:
            self._events.append((cat, name, began, ended - began, 0 if ident == self._main else ident, args))
            if len(self._events) >= FLUSH_EVERY:
                self._write()

    def _write(self) -> None:
        """Write the buffered events. Never raises: it runs inside collectives, and an error on one
        rank there would strand the others. A failed write (a full disk) ends the timeline."""
        global writer
        events, self._events = self._events, []
        if not events or self._file.closed:
            return
        try:
            self._file.write("".join(_line(*e) for e in events))
            self._file.flush()
        except OSError as exc:
            if writer is self:
                writer = None
            with contextlib.suppress(OSError):
                self._file.close()
            logger.warning(f"the timeline stopped: writing {self.path} failed ({exc})", extra=ANY_RANK)

    def close(self) -> None:
        with self._lock:
            self._write()
            with contextlib.suppress(OSError):
                self._file.close()

    # -- the collectives' hooks (the library calls these only while the timeline is on) --

    def handshake(self, collectives: Any, seq: int, kind: str, began: float, ended: float) -> str:
        """A completed handshake; returns the call site (the flight recorder keeps it)."""
        site = _site()
        self.pending_handshake += ended - began
        self.pending_site = site
        comm = getattr(collectives, "timeline_label", None) or _label(collectives)
        self.add("handshake", "handshake", began, ended, (comm, seq, kind))
        return site

    def collective(self, collectives: Any, kind: str, began: float, ended: float, args: Any) -> None:
        """A completed (or failed) outermost collective, with what it sent."""
        handshake, self.pending_handshake = self.pending_handshake, 0.0
        site, self.pending_site = self.pending_site, None
        self.add(
            "collective", kind, began, ended, (collectives.seq, site or _site(), _bytes(args), handshake)
        )


@functools.lru_cache(maxsize=4096)
def _quoted(text: str) -> str:
    import json  # imported by the Writer already

    return json.dumps(text)


def _line(cat: str, name: str, ts: float, dur: float, tid: int, args: tuple[Any, ...]) -> str:
    """One event as a JSON line, times in seconds (formatted by hand: ``json.dumps`` is 10x slower).

    ``args`` by ``cat``: a handshake's (communicator, seq, kind), a collective's (seq, call
    site, bytes, seconds in handshakes), none for a span.
    """
    head = f'{{"cat":"{cat}","name":{_quoted(name)},"ts":{ts!r},"dur":{dur!r},"tid":{tid % 100_000}'
    if cat == "handshake":
        comm, seq, kind = args
        return f'{head},"args":{{"comm":{_quoted(comm)},"seq":{seq},"kind":{_quoted(kind)}}}}}\n'
    if cat == "collective":
        seq, site, nbytes, handshake = args
        transfer = max(dur - handshake, 0.0)
        return (
            f'{head},"args":{{"seq":{seq},"site":{_quoted(site)},"bytes":{nbytes},'
            f'"handshake_ms":{handshake * 1e3:.6f},"transfer_ms":{transfer * 1e3:.6f}}}}}\n'
        )
    return head + "}\n"


def _bytes(args: Any) -> int:
    """Bytes of the arrays in a collective's arguments (plain arrays at once, nests walked)."""
    total = 0
    for a in args:
        nbytes = getattr(a, "nbytes", None)
        if isinstance(nbytes, int):
            total += nbytes
        elif isinstance(a, (list, tuple, dict)):
            with contextlib.suppress(Exception):  # what optree cannot walk has no known size: not an error
                total += sum(getattr(leaf, "nbytes", 0) or 0 for leaf in nest.tree_flatten(a)[0])
    return int(total)


def register(collectives: Any) -> None:
    """Name ``collectives`` the same on every member rank: its members and how many came before."""
    comm = collectives.comm
    if comm == MPI.COMM_NULL:
        return
    world = MPI.COMM_WORLD.Get_group()
    members = tuple(comm.Get_group().Translate_ranks(list(range(collectives.size)), world))
    counter = _members.setdefault(members, itertools.count())
    collectives.timeline_label = f"{min(members)}+{len(members)}#{next(counter)}"


def _label(collectives: Any) -> str:
    register(collectives)
    return collectives.timeline_label


class _Span:
    __slots__ = ("began", "name")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> _Span:
        self.began = time.monotonic()
        return self

    def __exit__(self, *exc: Any) -> None:
        active = writer
        if active is not None:
            active.add("span", self.name, self.began, time.monotonic())


class _Off:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_OFF = _Off()


def trace(name: str) -> Any:
    """A span of the program's own on the timeline: ``with mpistrat.trace("forward"): ...``.

    Off (no timeline), it records nothing and costs one attribute test.
    """
    return _OFF if writer is None else _Span(name)


def start_timeline(directory: str) -> str:
    """Write this rank's timeline to ``directory`` from now on (every rank calls it); returns its file.

    >>> import tempfile
    >>> path = start_timeline(tempfile.mkdtemp())
    >>> import os
    >>> os.path.basename(path).startswith("rank-") and path.endswith(".jsonl")  # rank-00000.jsonl on rank 0
    True
    >>> stop_timeline()
    """
    global writer, _exit_registered
    if writer is not None:
        if os.path.abspath(writer.directory) == os.path.abspath(directory):
            return writer.path
        stop_timeline()
    writer = Writer(directory)
    if not _exit_registered:
        _exit_registered = True
        atexit.register(stop_timeline)
    return writer.path


def stop_timeline() -> None:
    """Write what is buffered and close this rank's timeline file (also done at exit)."""
    global writer
    active, writer = writer, None
    if active is not None:
        active.close()


def from_environment(directory: str | None) -> None:
    """Start the timeline in ``directory`` (``MPISTRAT_TIMELINE``) unless one is running."""
    if directory and writer is None:
        start_timeline(directory)
