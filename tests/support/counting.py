"""A communicator that counts every MPI call mpistrat makes on it, and the bytes each moves.

mpi4py's ``Intracomm`` can be subclassed and ``Dup`` returns the subclass, so a strategy
built on ``CountingComm(comm)`` records everything it sends on its private duplicate.
Each call is logged as (name, bytes this rank sent, bytes this rank received, the
communicator's name): the payload a rank hands to MPI or gets back, which is what grows
(or must not grow) with the number of ranks. Pickled (lower-case) calls count their
pickles' sizes. ``Split`` and ``Split_type`` give counting communicators too, so the node
and leader communicators of a hierarchical sum are counted, each under its own name.

>>> from mpi4py import MPI
>>> import numpy as np
>>> comm = CountingComm(MPI.COMM_SELF).Dup()
>>> with Ledger.recording() as ledger:
...     comm.Allreduce(np.ones(4), np.empty(4))
>>> ledger.calls, ledger.sent, ledger.received
(1, 32, 32)
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
from mpi4py import MPI


def _nbytes(spec: Any) -> int:
    """Bytes of the buffer in an mpi4py buffer spec (``buf``, ``[buf, type]``, ``[buf, counts, displs]``)."""
    if spec is None or spec is MPI.IN_PLACE:
        return 0
    if isinstance(spec, (list, tuple)):
        spec = spec[0]
    nbytes = getattr(spec, "nbytes", None)
    return int(nbytes) if nbytes is not None else memoryview(spec).nbytes


def _pickled(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


@dataclasses.dataclass
class Call:
    name: str
    sent: int
    received: int
    comm: str = ""  # the communicator's name (MPI_Comm_get_name)


@dataclasses.dataclass
class Ledger:
    """What one rank did on counting communicators while recording."""

    log: list[Call] = dataclasses.field(default_factory=list)
    active: bool = False

    @property
    def calls(self) -> int:
        return len(self.log)

    @property
    def sent(self) -> int:
        return sum(c.sent for c in self.log)

    @property
    def received(self) -> int:
        return sum(c.received for c in self.log)

    @property
    def moved(self) -> int:
        """Bytes in and out of this rank."""
        return self.sent + self.received

    def names(self) -> list[str]:
        return [c.name for c in self.log]

    def without(self, *names: str) -> Ledger:
        """The calls other than ``names``."""
        return Ledger([c for c in self.log if c.name not in names])

    def only(self, *names: str) -> Ledger:
        return Ledger([c for c in self.log if c.name in names])

    def on(self, comm: str) -> Ledger:
        """The calls made on the communicator named ``comm``."""
        return Ledger([c for c in self.log if c.comm == comm])

    @classmethod
    @contextlib.contextmanager
    def recording(cls) -> Iterator[Ledger]:
        """Record every counting communicator's calls on this rank inside the block."""
        ledger = cls(active=True)
        _LEDGERS.append(ledger)
        try:
            yield ledger
        finally:
            _LEDGERS.remove(ledger)
            ledger.active = False


_LEDGERS: list[Ledger] = []


def _note(name: str, sent: int, received: int, comm: str = "") -> None:
    for ledger in _LEDGERS:
        ledger.log.append(Call(name, sent, received, comm))


class CountingPrequest(MPI.Prequest):
    """A persistent collective that logs each start as the call it repeats (``Allreduce_init``'s
    requests as ``Allreduce``): what it moves per start, not once at its creation."""

    def __new__(cls, request: MPI.Prequest, *call: Any) -> CountingPrequest:
        return super().__new__(cls, request)  # a copy of the handle; MPI's constructor takes only it

    def __init__(self, request: MPI.Prequest, name: str, nbytes: int, comm: str):
        self.call = (name, nbytes, nbytes, comm)

    def Start(self) -> None:
        _note(*self.call)
        return super().Start()


class CountingComm(MPI.Intracomm):
    """An intracommunicator that logs its calls into the active :class:`Ledger` (if any)."""

    def _root(self, root: int) -> bool:
        return self.Get_rank() == root

    def Split(self, color: int = 0, key: int = 0) -> MPI.Intracomm:
        new = super().Split(color, key)
        return new if new == MPI.COMM_NULL else CountingComm(new)

    def Split_type(self, split_type: int, key: int = 0, info: MPI.Info = MPI.INFO_NULL) -> MPI.Intracomm:
        new = super().Split_type(split_type, key, info)
        return new if new == MPI.COMM_NULL else CountingComm(new)

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = MPI.SUM, root: int = 0) -> None:
        n = _nbytes(recvbuf if sendbuf is MPI.IN_PLACE else sendbuf)
        _note("Reduce", 0 if self._root(root) else n, n if self._root(root) else 0, self.Get_name())
        return super().Reduce(sendbuf, recvbuf, op, root)

    # -- buffer (upper-case) collectives ---------------------------------------------

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = MPI.SUM) -> None:
        n = _nbytes(recvbuf)
        _note("Allreduce", n, n, self.Get_name())
        return super().Allreduce(sendbuf, recvbuf, op)

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Any = MPI.SUM) -> MPI.Request:
        n = _nbytes(recvbuf)
        _note("Allreduce", n, n, self.Get_name())
        return super().Iallreduce(sendbuf, recvbuf, op)

    def Allreduce_init(
        self, sendbuf: Any, recvbuf: Any, op: Any = MPI.SUM, info: MPI.Info = MPI.INFO_NULL
    ) -> MPI.Prequest:
        request = super().Allreduce_init(sendbuf, recvbuf, op, info)
        return CountingPrequest(request, "Allreduce", _nbytes(recvbuf), self.Get_name())

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        received = _nbytes(recvbuf)
        # in place, this rank's block of the receive buffer is what it hands to MPI
        sent = received // self.Get_size() if sendbuf is MPI.IN_PLACE else _nbytes(sendbuf)
        _note("Allgather", sent, received, self.Get_name())
        return super().Allgather(sendbuf, recvbuf)

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        _note("Alltoall", _nbytes(sendbuf), _nbytes(recvbuf), self.Get_name())
        return super().Alltoall(sendbuf, recvbuf)

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = MPI.SUM) -> None:
        if sendbuf is MPI.IN_PLACE:  # the input is the whole receive buffer, the result its first block
            n = _nbytes(recvbuf)
            _note("Reduce_scatter_block", n, n // self.Get_size(), self.Get_name())
        else:
            _note("Reduce_scatter_block", _nbytes(sendbuf), _nbytes(recvbuf), self.Get_name())
        return super().Reduce_scatter_block(sendbuf, recvbuf, op)

    def Ireduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = MPI.SUM) -> MPI.Request:
        n = _nbytes(recvbuf if sendbuf is MPI.IN_PLACE else sendbuf)
        received = n // self.Get_size() if sendbuf is MPI.IN_PLACE else _nbytes(recvbuf)
        _note("Reduce_scatter_block", n, received, self.Get_name())
        return super().Ireduce_scatter_block(sendbuf, recvbuf, op)

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        _note("Allgatherv", _nbytes(sendbuf), _nbytes(recvbuf), self.Get_name())
        return super().Allgatherv(sendbuf, recvbuf)

    def Bcast(self, buf: Any, root: int = 0) -> None:
        n = _nbytes(buf)
        _note("Bcast", n if self._root(root) else 0, 0 if self._root(root) else n, self.Get_name())
        return super().Bcast(buf, root)

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        _note("Gather", _nbytes(sendbuf), _nbytes(recvbuf) if self._root(root) else 0, self.Get_name())
        return super().Gather(sendbuf, recvbuf, root)

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        _note("Gatherv", _nbytes(sendbuf), _nbytes(recvbuf) if self._root(root) else 0, self.Get_name())
        return super().Gatherv(sendbuf, recvbuf, root)

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        _note("Scatterv", _nbytes(sendbuf) if self._root(root) else 0, _nbytes(recvbuf), self.Get_name())
        return super().Scatterv(sendbuf, recvbuf, root)

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        _note("Send", _nbytes(buf), 0, self.Get_name())
        return super().Send(buf, dest, tag)

    def Sendrecv(
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = MPI.ANY_SOURCE,
        recvtag: int = MPI.ANY_TAG,
        status: Any = None,
    ) -> None:
        _note("Sendrecv", _nbytes(sendbuf), _nbytes(recvbuf), self.Get_name())
        return super().Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)

    def Recv(
        self, buf: Any, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, status: Any = None
    ) -> None:
        _note("Recv", 0, _nbytes(buf), self.Get_name())
        return super().Recv(buf, source, tag, status)

    # -- pickled (lower-case) calls ------------------------------------------------------

    def bcast(self, obj: Any, root: int = 0) -> Any:
        out = super().bcast(obj, root)
        n = _pickled(out)
        _note("bcast", n if self._root(root) else 0, 0 if self._root(root) else n, self.Get_name())
        return out

    def gather(self, sendobj: Any, root: int = 0) -> Any:
        out = super().gather(sendobj, root)
        received = sum(map(_pickled, out)) - _pickled(sendobj) if self._root(root) else 0
        _note("gather", 0 if self._root(root) else _pickled(sendobj), received, self.Get_name())
        return out

    def scatter(self, sendobj: Any, root: int = 0) -> Any:
        out = super().scatter(sendobj, root)
        sent = sum(map(_pickled, sendobj)) - _pickled(out) if self._root(root) else 0
        _note("scatter", sent, 0 if self._root(root) else _pickled(out), self.Get_name())
        return out

    def allgather(self, sendobj: Any) -> Any:
        out = super().allgather(sendobj)
        _note("allgather", _pickled(sendobj), sum(map(_pickled, out)), self.Get_name())
        return out

    def allreduce(self, sendobj: Any, op: Any = MPI.SUM) -> Any:
        out = super().allreduce(sendobj, op)
        _note("allreduce", _pickled(sendobj), _pickled(out), self.Get_name())
        return out

    def isend(self, obj: Any, dest: int, tag: int = 0) -> MPI.Request:
        _note("isend", _pickled(obj), 0, self.Get_name())
        return super().isend(obj, dest, tag)

    def issend(self, obj: Any, dest: int, tag: int = 0) -> MPI.Request:
        _note("issend", _pickled(obj), 0, self.Get_name())
        return super().issend(obj, dest, tag)

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        _note("send", _pickled(obj), 0, self.Get_name())
        return super().send(obj, dest, tag)


def ring_bytes(call: Call, size: int) -> float:
    """Bytes a bandwidth-optimal (ring) algorithm sends from this rank for ``call``, among ``size`` ranks.

    An all-reduce of n bytes sends 2n(R-1)/R; a reduce-scatter of n bytes, or an all-gather
    into n bytes, sends n(R-1)/R each: together, what the all-reduce sends. An all-to-all of n
    bytes keeps 1/R of them and sends the rest.

    >>> ring_bytes(Call("Allreduce", 100, 100), 4), ring_bytes(Call("Reduce_scatter_block", 100, 25), 4)
    (150.0, 75.0)
    """
    share = (size - 1) / size
    if call.name == "Allreduce":
        return 2 * call.received * share
    if call.name in ("Reduce_scatter_block", "Alltoall"):
        return call.sent * share
    if call.name == "Allgather":
        return call.received * share
    raise ValueError(f"no ring model for {call.name}")


def nbytes(*arrays: Any) -> int:
    """Total bytes of ``arrays`` (the ideal payload of one collective over them)."""
    return sum(int(np.asarray(a).nbytes) for a in arrays)
