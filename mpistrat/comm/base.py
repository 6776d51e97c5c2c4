"""What every transport does: the interface :mod:`.transport` and :mod:`.nccl` implement.

Its own module so that the NCCL transport and the chooser in :mod:`.transport` (which
imports it lazily) do not import each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Transport"]


class Transport:
    """Moves 1-D contiguous buffers of one dtype across the ranks of a communicator."""

    name = "transport"

    def supports_reduce(self, dtype: np.dtype) -> bool:
        return True

    def allreduce(self, send: Any, recv: Any) -> None:
        raise NotImplementedError

    def allgatherv(self, send: Any, recv: Any, counts: Sequence[int], displs: Sequence[int]) -> None:
        raise NotImplementedError

    def bcast(self, buf: Any, root: int) -> None:
        """Overwrite ``buf`` on every rank with root's ``buf``."""
        raise NotImplementedError

    def reduce_scatter(self, buf: Any) -> None:
        """Sum ``buf`` (``size`` equal blocks, in place): rank ``r``'s block of the sum lands at the
        start of its ``buf``; the rest is left undefined."""
        raise NotImplementedError

    def allgather(self, buf: Any) -> None:
        """Rank ``r``'s block ``r`` of ``buf`` (``size`` equal blocks) to every rank, in place."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the transport holds (communicators, pinned memory)."""
