"""What rank 0 of ``mpistrat bench`` shows while the sweep runs: the table row by row, and progress.

Every finished row is printed at once (the table on stdout, so a job's log and ``| tee`` hold
each row as it comes). Progress goes to stderr: tqdm's bar where a person watches
(:func:`mpistrat.log.from_terminal`) and tqdm is installed, else one line per size, never a
redrawn bar in a batch log. ``--progress`` asks for the bar, ``--no-progress`` for neither.
"""

from __future__ import annotations

import sys
from typing import Any

from mpistrat.log import from_terminal

__all__ = ["Display", "choose"]


class Display:
    """The table, row by row (rank 0's, unless ``--quiet``); no progress."""

    def __init__(self, table: bool, total: int):
        self.table, self.total = table, total

    def lines(self, lines: list[str]) -> None:
        if self.table:
            for line in lines:
                self.write(line)

    def write(self, line: str) -> None:
        print(line, flush=True)

    def step(self, done: int, what: str, elapsed: float) -> None:
        """``done`` of the sizes are measured, the last being ``what``, ``elapsed`` s into the sweep."""

    def close(self) -> None:
        pass


class _Lines(Display):
    """One line on stderr per size: where no person watches (a batch log), or no tqdm."""

    def step(self, done: int, what: str, elapsed: float) -> None:
        print(
            f"mpistrat bench: {done}/{self.total} sizes measured ({what}), {elapsed:.0f} s",
            file=sys.stderr,
            flush=True,
        )


class _Bar(Display):
    """tqdm's bar on stderr; the table's lines are written above it."""

    def __init__(self, table: bool, total: int, tqdm: Any):
        super().__init__(table, total)
        self.tqdm = tqdm
        self.bar = tqdm(total=total, desc="mpistrat bench", unit="size", file=sys.stderr, dynamic_ncols=True)

    def write(self, line: str) -> None:
        self.tqdm.write(line, file=sys.stdout)

    def step(self, done: int, what: str, elapsed: float) -> None:
        self.bar.set_postfix_str(what, refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def choose(asked: bool | None, rank0: bool, total: int, quiet: bool) -> Display:
    """Rank 0's display of a sweep of ``total`` sizes (other ranks show nothing). ``asked``:
    ``--progress`` (True), ``--no-progress`` (False), neither (None: a bar where a person watches)."""
    if not rank0:
        return Display(False, total)
    table = not quiet
    if asked is False:
        return Display(table, total)
    if asked or from_terminal():
        try:
            from tqdm import tqdm
        except ImportError:
            if asked:
                print(
                    "mpistrat bench: --progress: tqdm is not installed (pip install tqdm, or the progress "
                    "extra): a line per size instead",
                    file=sys.stderr,
                    flush=True,
                )
        else:
            return _Bar(table, total, tqdm)
    return _Lines(table, total)
