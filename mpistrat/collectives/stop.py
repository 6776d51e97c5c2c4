"""A stop asked for on any rank, which every handshake carries (preemption).

Its own module so that ``state.CollectiveState`` can name it: the handshake is typed against that
protocol.
"""

from __future__ import annotations

__all__ = ["StopState"]


class StopState:
    """A stop asked for on this rank, and whether one has reached every rank (preemption).

    Each ``Collectives`` owns one (``collectives.stop``) and passes it to whoever asks to
    stop. :meth:`request` only sets a flag (safe in a signal handler); the next handshake
    carries it (``Allreduce(MAX)``), and from that collective on :attr:`agreed` is true on
    every rank. :meth:`clear` once the stop was handled.

    >>> stop = StopState()
    >>> stop.request(); stop.requested, stop.agreed
    (True, False)
    """

    __slots__ = ("_agreed", "requested")

    def __init__(self) -> None:
        self.requested = False  # read by every handshake: a plain attribute, no property
        self._agreed = False

    def request(self) -> None:
        """Ask every rank to stop: the next handshake carries the request."""
        self.requested = True

    @property
    def agreed(self) -> bool:
        """Whether a handshake has carried some rank's request (the same answer on every rank)."""
        return self._agreed

    def reached(self) -> None:
        """The handshake's: some rank's request reached every rank at this collective."""
        self._agreed = True

    def clear(self) -> None:
        """Forget the request and the agreement (the stop was handled)."""
        self.requested = self._agreed = False
