"""Is the loaded MPI library CUDA-aware? Decided at run time, never guessed.

Handing a device pointer to an MPI that cannot read device memory crashes the
process, so device buffers go straight to MPI only when the answer is a firm yes.
In order:

1. ``MPISTRAT_CUDA_AWARE=0|1`` in the environment decides (and no library is queried).
2. ``MPIX_Query_cuda_support()`` (Open MPI, MPICH >= 4.1) or
   ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)`` (MPICH >= 4.0), looked up with
   ctypes in the MPI library mpi4py loaded; a missing symbol moves on to the next.
3. Libraries with no query but a documented switch: Cray MPICH with
   ``MPICH_GPU_SUPPORT_ENABLED=1``, MVAPICH2 with ``MV2_USE_CUDA=1``.
4. Otherwise: not CUDA-aware (device buffers are staged through host memory).

>>> detect(env={"MPISTRAT_CUDA_AWARE": "1"})
CudaAwareness(aware=True, how='MPISTRAT_CUDA_AWARE=1 in the environment')
>>> class NoQuery:  # a library without either symbol
...     pass
>>> detect(libraries=[("libmpi.so", NoQuery())], env={}, library_version="MPICH 4.0").aware
False
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
from collections.abc import Iterable, Mapping
from typing import Any

from mpistrat import config

__all__ = ["ENV", "CudaAwareness", "cuda_awareness", "detect", "mpi_libraries", "query_library"]

ENV = "MPISTRAT_CUDA_AWARE"
# From MPICH's mpi.h: enum values of MPIX_GPU_query_support's first argument.
MPIX_GPU_SUPPORT_CUDA = 0


@dataclasses.dataclass(frozen=True)
class CudaAwareness:
    """Whether MPI may be handed device pointers, and how that was decided."""

    aware: bool
    how: str


def detect(
    libraries: Iterable[tuple[str, Any]] | None = None,
    env: Mapping[str, str] | None = None,
    library_version: str | None = None,
) -> CudaAwareness:
    """Decide whether the MPI library is CUDA-aware (see the module docstring for the order).

    Args:
        libraries: ``(name, handle)`` pairs to query, where a handle exposes the C
            symbols as attributes (a ``ctypes.CDLL``); default: the loaded MPI library.
        env: the environment (default ``os.environ``).
        library_version: ``MPI.Get_library_version()`` (default: asked of mpi4py).
    """
    env = os.environ if env is None else env
    override = config.read(ENV, env)
    if override is not None:
        return CudaAwareness(override, f"{ENV}={env[ENV].strip()} in the environment")
    raw = env.get(ENV, "").strip()
    ignored = f"{ENV}={raw!r} is not 0 or 1 and was ignored; " if raw.lower() not in ("", "auto") else ""
    if libraries is None:
        from mpi4py import MPI

        if not MPI.Is_initialized() or MPI.Is_finalized():
            return CudaAwareness(False, ignored + "MPI is not initialized, so it could not be queried")
        libraries = mpi_libraries()
    if library_version is None:
        from mpi4py import MPI

        library_version = MPI.Get_library_version()
    looked = []
    for name, handle in libraries:
        looked.append(name)
        answer = query_library(handle)
        if answer is not None:
            aware, call = answer
            return CudaAwareness(aware, ignored + f"{call} returned {int(aware)} in {name}")
    hint = _documented_switch(library_version, env)
    if hint is not None:
        return CudaAwareness(True, ignored + hint)
    where = ", ".join(looked) if looked else "no MPI library found"
    return CudaAwareness(
        False,
        ignored
        + f"no CUDA-awareness query in the MPI library ({where}); "
        + f"device buffers are staged through host memory (set {ENV}=1 if this MPI is CUDA-aware)",
    )


def query_library(handle: Any) -> tuple[bool, str] | None:
    """Ask one library handle; ``(aware, call)``, or None when it has no usable query.

    A symbol that is missing, raises, or answers something other than 0/1 counts as
    no answer, so the caller falls back to the safe choice.
    """
    query = _symbol(handle, "MPIX_Query_cuda_support")
    if query is not None:
        try:
            query.restype = ctypes.c_int
            query.argtypes = []
            value = int(query())
        except Exception:
            value = -1
        if value in (0, 1):
            return bool(value), "MPIX_Query_cuda_support()"
    query = _symbol(handle, "MPIX_GPU_query_support")
    if query is not None:
        flag = ctypes.c_int(-1)
        try:
            query.restype = ctypes.c_int
            query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            status = int(query(MPIX_GPU_SUPPORT_CUDA, ctypes.pointer(flag)))
        except Exception:
            status = -1
        if status == 0 and flag.value in (0, 1):
            return bool(flag.value), "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)"
    return None


def _symbol(handle: Any, name: str) -> Any:
    try:
        return getattr(handle, name)
    except (AttributeError, OSError, ValueError):
        return None


def _documented_switch(library_version: str, env: Mapping[str, str]) -> str | None:
    version = library_version.upper()
    if "CRAY MPICH" in version and env.get("MPICH_GPU_SUPPORT_ENABLED", "").strip() == "1":
        return "Cray MPICH with MPICH_GPU_SUPPORT_ENABLED=1 (no query function in this library)"
    if "MVAPICH" in version and env.get("MV2_USE_CUDA", "").strip() == "1":
        return "MVAPICH2 with MV2_USE_CUDA=1 (no query function in this library)"
    return None


def mpi_libraries() -> list[tuple[str, Any]]:
    """Handles on the MPI library mpi4py loaded, most specific first (already-loaded objects only)."""
    found: list[tuple[str, Any]] = []
    seen: set[str] = set()

    def add(name: str, path: str | None) -> None:
        if name in seen:
            return
        seen.add(name)
        try:
            mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
            found.append((name, ctypes.CDLL(path, mode=mode)))
        except OSError:
            pass

    libmpi = os.environ.get("MPI4PY_LIBMPI")
    if libmpi:
        add(os.path.basename(libmpi), libmpi)
    for path in _loaded_libmpi():
        add(os.path.basename(path), path)
    from mpi4py import MPI

    # dlsym on the extension's handle also searches the libraries it was linked against.
    add(f"{os.path.basename(MPI.__file__)} and its dependencies", MPI.__file__)
    add("the global symbol namespace", None)
    return found


@functools.lru_cache(maxsize=1)
def _loaded_libmpi() -> tuple[str, ...]:
    """Paths of loaded shared objects named like an MPI library (Linux /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return ()
    names = ("libmpi.so", "libmpi_cray.so", "libmpich.so", "libmpi_abi.so")
    return tuple(sorted(p for p in paths if os.path.basename(p).startswith(names)))


@functools.lru_cache(maxsize=1)
def _library_answer() -> CudaAwareness:
    return detect(env={k: v for k, v in os.environ.items() if k != ENV})


def cuda_awareness() -> CudaAwareness:
    """This process's answer: the environment override, else the library query (asked once)."""
    if os.environ.get(ENV, "").strip():
        return detect()
    return _library_answer()
