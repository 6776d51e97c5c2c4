"""How floating-point sums travel: one object per reduction setting, chosen once per call.

``CommunicationOptions`` names the setting (``deterministic=True``, ``compression="bf16"``);
:func:`sum_mode` turns it into one of:

- :data:`PLAIN`: MPI's own sum. It takes no dtype: callers sum every pack their plain way
  (MPI for host buffers, the transports for device buffers).
- :data:`EXACT`: the exact sum rounded once (:mod:`.exact_sum`); it takes the IEEE float and
  complex dtypes.
- :data:`BF16`, :data:`FP16`: 16-bit values on the wire (:mod:`.compressed`; between nodes only
  under ``HIERARCHICAL``); they take float32 and float64.

A mode owns what differs between them: which dtypes it takes, the code the handshake mixes in
(ranks that would reduce differently disagree instead of mixing limbs with floats), whether an
overflow can surface after data has moved, and the host staging of device buffers.

>>> import numpy as np
>>> from mpi4py import MPI
>>> from mpistrat.collectives import Collectives
>>> mode = sum_mode(CommunicationOptions(compression="bf16"))
>>> mode.name, mode.takes(np.dtype(np.float32)), mode.takes(np.dtype(np.int32))
('bf16', True, False)
>>> mode.sum(Collectives(MPI.COMM_SELF.Dup()), np.array([1.0, 3.0], np.float32), kind="all_reduce").tolist()
[1.0, 3.0]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.fingerprint import code_of
from mpistrat.comm import mpi, packing
from mpistrat.options import CommunicationImplementation, CommunicationOptions

if TYPE_CHECKING:
    from mpistrat.collectives.ranks import Ranks

__all__ = ["BF16", "EXACT", "FP16", "PLAIN", "SumMode", "route_code", "sum_mode"]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))  # what 16-bit compression takes


class SumMode:
    """MPI's own sum (the base: takes nothing, costs nothing in the handshake)."""

    name = ""  # CommunicationOptions.reduction's name for it
    fails_late = False  # an error (16-bit overflow) may come after some packs were reduced

    def __init__(self) -> None:
        self.code = code_of("CommunicationOptions.reduction", self.name) if self.name else 0

    def __repr__(self) -> str:
        return f"<sum mode {self.name or 'plain'}>"

    def takes(self, dtype: np.dtype) -> bool:
        """Whether this mode sums ``dtype`` (the other dtypes go the plain way)."""
        return False

    def sum(
        self,
        collectives: Ranks,
        buf: Any,
        *,
        kind: str,
        mean: bool = False,
        implementation: CommunicationImplementation = CommunicationImplementation.AUTO,
    ) -> Any:
        """The sum (``mean``: average) over every rank of the 1-D ``buf``, a new array where ``buf``
        lives (device buffers are staged through host memory). Collective."""
        host = buf if type(buf) is np.ndarray else buf.get()
        result = self._sum_host(collectives, host, kind, mean, implementation)
        return result if type(buf) is np.ndarray else packing.array_module(buf).asarray(result)

    def reduce_scatter(self, collectives: Ranks, buf: np.ndarray, kind: str) -> None:
        """Rank ``r``'s block (of ``size`` equal blocks) of the sum of the host ``buf``, at its start."""
        per = buf.size // collectives.size
        if mpi.COUNT_LIMIT is not None and per > mpi.COUNT_LIMIT:  # an all-reduce in pieces, then the block
            mpi.allreduce(collectives.comm, MPI.IN_PLACE, buf)
            buf[:per] = buf[collectives.rank * per : (collectives.rank + 1) * per]
        else:
            collectives.comm.Reduce_scatter_block(MPI.IN_PLACE, buf, op=MPI.SUM)

    def _sum_host(
        self, collectives: Ranks, host: np.ndarray, kind: str, mean: bool, implementation: Any
    ) -> np.ndarray:
        # PLAIN takes no dtype: its callers sum every pack their plain way, never through here.
        raise NotImplementedError(f"{self!r} has no sum of its own")


class _Exact(SumMode):
    """``deterministic=True``: the exact sum of the contributions, rounded once."""

    name = "deterministic"

    def takes(self, dtype: np.dtype) -> bool:
        from mpistrat.collectives import exact_sum  # each mode's own module: imported when it is used

        return exact_sum.supported(dtype)

    def reduce_scatter(self, collectives: Ranks, buf: np.ndarray, kind: str) -> None:
        # The exact all-reduce of the whole buffer, this rank's block kept (twice a reduce-scatter's bytes).
        per = buf.size // collectives.size
        total = self.sum(collectives, buf, kind=kind)
        buf[:per] = total[collectives.rank * per : (collectives.rank + 1) * per]

    def _sum_host(
        self, collectives: Ranks, host: np.ndarray, kind: str, mean: bool, implementation: Any
    ) -> np.ndarray:
        from mpistrat.collectives import exact_sum

        real = host.view(host.real.dtype) if host.dtype.kind == "c" else host
        divisor = collectives.size if mean else None
        summed, _ = exact_sum.exact_sum(collectives.comm, real.reshape(1, -1), [], divisor)
        return summed.view(host.dtype)


class _Compressed(SumMode):
    """``compression="bf16"`` or ``"fp16"``: 16-bit values on the wire, summed in float32."""

    fails_late = True

    def __init__(self, codec: str):
        self.name = codec
        super().__init__()

    def takes(self, dtype: np.dtype) -> bool:
        return dtype in _FLOATS

    def reduce_scatter(self, collectives: Ranks, buf: np.ndarray, kind: str) -> None:
        from mpistrat.collectives import compressed

        per = buf.size // collectives.size
        buf[:per] = compressed.compressed_reduce_scatter(collectives.comm, buf, self.name, kind)

    def _sum_host(
        self, collectives: Ranks, host: np.ndarray, kind: str, mean: bool, implementation: Any
    ) -> np.ndarray:
        from mpistrat.collectives import compressed, hierarchical

        if implementation is CommunicationImplementation.HIERARCHICAL:
            return hierarchical.compressed_sum(collectives, host, self.name, mean, kind)
        return compressed.compressed_sum(collectives.comm, host, self.name, mean, kind)


PLAIN = SumMode()
EXACT = _Exact()
BF16 = _Compressed("bf16")
FP16 = _Compressed("fp16")
_MODES = {m.name: m for m in (PLAIN, EXACT, BF16, FP16)}


def sum_mode(options: CommunicationOptions) -> SumMode:
    """The mode ``options`` ask for (their ``reduction``)."""
    return _MODES[options.reduction]


def route_code(implementation: CommunicationImplementation) -> int:
    """What a handshake's fingerprint mixes in for the route of host sums (0 for flat MPI): ranks
    that would sum over different communicators (``hierarchical.py``) disagree, and raise, instead
    of waiting forever."""
    if implementation is CommunicationImplementation.HIERARCHICAL:
        return code_of("CommunicationOptions.implementation", "HIERARCHICAL")
    return 0
