"""Where the program is: the innermost frame outside mpistrat, for messages and traces (and, in a
traceback, where an exception passed)."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["cached_call_site", "call_site", "traceback_site"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # mpistrat/


def call_site(frame: Any = None) -> str:
    """The innermost place outside mpistrat on a stack, as ``file:line in function``.

    >>> call_site().endswith("in <module>")
    True
    """
    f = frame if frame is not None else sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE):
        f = f.f_back
    if f is None:
        return "<inside mpistrat>"
    return _place(f.f_code, f.f_lineno)


def traceback_site(tb: Any) -> str:
    """The innermost place outside mpistrat in a traceback, where the exception passed.

    >>> try:
    ...     raise KeyboardInterrupt
    ... except KeyboardInterrupt as exc:
    ...     traceback_site(exc.__traceback__).endswith(":2 in <module>")
    True
    """
    site = "<inside mpistrat>"
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(_PACKAGE):
            site = _place(code, tb.tb_lineno)
        tb = tb.tb_next
    return site


def _place(code: Any, line: int | None) -> str:
    path = code.co_filename
    try:
        relative = os.path.relpath(path)
        path = relative if not relative.startswith("..") else path
    except ValueError:
        pass
    return f"{path}:{line} in {code.co_name}"


_inside: set[int] = set()  # ids of mpistrat's code objects (they live as long as the process)
_sites: dict[tuple[str, str, int], str] = {}


def cached_call_site() -> str:
    """:func:`call_site` of the caller's stack, cached per place (the timeline asks on every collective).

    >>> cached_call_site() == call_site()
    True
    """
    f: Any = sys._getframe(1)
    while f is not None:
        code = f.f_code
        if id(code) not in _inside:
            if not code.co_filename.startswith(_PACKAGE):
                break
            _inside.add(id(code))
        f = f.f_back
    if f is None:
        return "<inside mpistrat>"
    key = (f.f_code.co_filename, f.f_code.co_name, f.f_lineno)
    site = _sites.get(key)
    if site is None:
        site = _sites[key] = call_site(f)
    return site
