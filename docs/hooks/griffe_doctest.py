"""Griffe extension for the docs build: docstrings written for ``help()`` read well as Markdown.

Markdown would read ``>>>`` as nested block quotes and ``[...]`` in the output
as links, so each doctest block (a ``>>>`` line and what follows it up to a
blank line) is wrapped in a ``pycon`` fence before mkdocstrings renders it; and
Sphinx roles such as ``:class:`X` `` become plain code.
"""

from __future__ import annotations

import re
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


_ROLE = re.compile(r":(?:class|meth|func|attr|mod|exc|data|obj):`(~?)([^`]+)`")


def strip_roles(text: str) -> str:
    """Sphinx cross-reference roles as inline code (``~`` keeps the last name only, as in Sphinx).

    >>> strip_roles("The :class:`~mpistrat.Strategy` and :meth:`Strategy.run`.")
    'The `Strategy` and `Strategy.run`.'
    """
    return _ROLE.sub(lambda m: f"`{m[2].rpartition('.')[2] if m[1] else m[2]}`", text)


class DoctestFences(griffe.Extension):
    """Fence every docstring's doctest blocks and turn its Sphinx roles into code."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = strip_roles(fence_doctests(obj.docstring.value))
