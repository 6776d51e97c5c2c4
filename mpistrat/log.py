"""The ``mpistrat`` logger: every record carries the rank; warnings come from rank 0 only.

Records get a ``rank`` attribute (the ``COMM_WORLD`` rank). Below ERROR, only rank 0's
records pass, so a warning every rank hits is printed once; a record logged with
``extra=ANY_RANK`` (a stall seen by whichever rank is waiting), and every ERROR, passes
on any rank. ``MPISTRAT_LOG_ALL_RANKS=1`` or ``configure(all_ranks=True)`` lets every
rank's warnings through. The level is INFO: what a batch log should say of normal events (a
checkpoint restored, a background save written) comes as INFO, what interrupts a job as
WARNING; ``configure(level="WARNING")`` keeps only the latter.

>>> import logging
>>> logger.name
'mpistrat'
>>> logger.warning("stalled")  # printed to stderr as "[mpistrat rank 0] WARNING: stalled"
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

from mpi4py import MPI

from mpistrat import config

__all__ = ["ANY_RANK", "configure", "from_terminal", "logger", "world_rank"]

ANY_RANK = {"any_rank": True}
FORMAT = "[mpistrat rank %(rank)s] %(levelname)s: %(message)s"

_all_ranks: bool | None = None  # None: the environment decides


def world_rank() -> int:
    """This process's rank in ``COMM_WORLD`` (0 before MPI is initialized or after it is finalized)."""
    try:
        if MPI.Is_initialized() and not MPI.Is_finalized():
            return MPI.COMM_WORLD.Get_rank()
    except Exception:  # a logger must never fail
        pass
    return 0


def from_terminal() -> bool:
    """Whether a person watches this process's output: stderr is a terminal, or (under ``mpiexec``,
    where every rank's output is a pipe) the process still has a controlling terminal. False in
    batch jobs, CI and ``nohup``: progress is then a line at a time, never a redrawn bar."""
    if sys.stderr.isatty():
        return True
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:  # no controlling terminal
        return False
    os.close(fd)
    return True


def _everyone() -> bool:
    if _all_ranks is not None:
        return _all_ranks
    return bool(config.read("MPISTRAT_LOG_ALL_RANKS"))


class RankFilter(logging.Filter):
    """Stamp ``record.rank``; drop records below ERROR from ranks other than 0 unless allowed."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = world_rank()
        record.rank = rank
        return (
            rank == 0 or record.levelno >= logging.ERROR or getattr(record, "any_rank", False) or _everyone()
        )


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (test runners swap it)."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def configure(*, all_ranks: bool | None = None, level: int | str | None = None) -> logging.Logger:
    """Let every rank's warnings through (``all_ranks=True``) and/or set the level; returns the logger.

    >>> configure(level="WARNING").level == logging.WARNING
    True
    """
    global _all_ranks
    if all_ranks is not None:
        _all_ranks = bool(all_ranks)
    if level is not None:
        logger.setLevel(level)
    return logger


logger = logging.getLogger("mpistrat")
logger.addFilter(RankFilter())
if logger.level == logging.NOTSET:  # a level the program set before importing mpistrat stays
    logger.setLevel(logging.INFO)
if not logger.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(_handler)
    # One line per message: the handler above prints it; the root logger would print it again.
    logger.propagate = False
