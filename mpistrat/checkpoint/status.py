"""What a restore matched: :class:`CheckpointLoadStatus`, as tf's load status.

>>> status = CheckpointLoadStatus("ckpt-1", missing=["model/b"], unused=[])
>>> status.expect_partial() is status
True
>>> status.assert_consumed()  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
AssertionError: Checkpoint.restore('ckpt-1'): tracked objects with no value ...: model/b
"""

from __future__ import annotations

import weakref

from mpistrat.log import logger

__all__ = ["CheckpointLoadStatus"]


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
