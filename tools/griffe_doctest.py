"""Griffe extension for the docs build: show doctest examples in docstrings as code.

Markdown would read ``>>>`` as nested block quotes and ``[...]`` in the output
as links, so each doctest block (a ``>>>`` line and what follows it up to a
blank line) is wrapped in a ``pycon`` fence before mkdocstrings renders it.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    r"""Wrap every doctest block of ``text`` in a fenced ``pycon`` code block.

    >>> fence_doctests("Add:\n>>> 1 + 1\n2").splitlines()
    ['Add:', '', '```pycon', '>>> 1 + 1', '2', '```']
    """
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        if out and out[-1].strip():
            out.append("")
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            out.append(lines[i])
            i += 1
        out.extend([f"{indent}```", ""])
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Rewrite every docstring's doctest blocks as fenced code."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
