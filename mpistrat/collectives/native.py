"""The compiled twins of ``MPISTRAT_CHECK=step``'s two hot paths (``native_step.c``): a learned
step's deferral of each data collective and its closing handshake.

``pip install .`` compiles them where it finds a C compiler (it goes on without one). They run
where they were built and ``MPISTRAT_NATIVE`` is on (the default; read once, at import); else
their Python twins in :mod:`.handshake` and :mod:`.step_check` run, to the same effect and with
the same messages, so ranks of either kind may share a job.

>>> from mpistrat.collectives import native
>>> native.describe() in ("compiled", "Python (not built)", "Python (MPISTRAT_NATIVE=0)")
True
"""

from __future__ import annotations

from types import ModuleType

from mpistrat import config

__all__ = ["describe", "native_step"]


def _load() -> tuple[ModuleType | None, str]:
    try:
        import mpistrat.collectives.native_step as module
    except ImportError:
        return None, "Python (not built)"
    if not config.read("MPISTRAT_NATIVE"):
        return None, "Python (MPISTRAT_NATIVE=0)"
    return module, "compiled"


native_step, _how = _load()


def describe() -> str:
    """Which twins run: ``compiled``, or ``Python`` and why (``mpistrat info`` shows it)."""
    return _how
