"""Where the program is: the innermost frame outside mpistrat, for messages and traces."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["call_site"]

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
    path = f.f_code.co_filename
    try:
        relative = os.path.relpath(path)
        path = relative if not relative.startswith("..") else path
    except ValueError:
        pass
    return f"{path}:{f.f_lineno} in {f.f_code.co_name}"
