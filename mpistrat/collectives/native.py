"""The compiled twin of ``MPISTRAT_CHECK=step``'s state (``native_step.c``): what every unchecked
collective reads and writes, and a step's record code.

``pip install .`` compiles it where it finds a C compiler (it goes on without one). Strategies use
it where it was built and ``MPISTRAT_NATIVE`` is on (the default; read once, at import); else the
Python twin in :mod:`.step_check`, to the same effect and with the same messages, so ranks of
either kind may share a job.

>>> from mpistrat.collectives import native
>>> native.describe() in ("compiled", "Python (not built)", "Python (MPISTRAT_NATIVE=0)")
True
"""

from __future__ import annotations

from types import ModuleType

from mpistrat import config

__all__ = ["chosen", "describe", "native_step"]


def _load() -> ModuleType | None:
    try:
        import mpistrat.collectives.native_step as module
    except ImportError:
        return None
    return module


native_step = _load()  # the compiled module, where it was built
chosen = native_step is not None and bool(config.read("MPISTRAT_NATIVE"))  # strategies use it


def describe() -> str:
    """Which twin strategies use: ``compiled``, or ``Python`` and why (``mpistrat info`` shows it)."""
    if chosen:
        return "compiled"
    return "Python (not built)" if native_step is None else "Python (MPISTRAT_NATIVE=0)"
