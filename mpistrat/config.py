"""Every ``MPISTRAT_*`` environment variable, read by one rule.

:func:`read` is the only reader. An unset or empty variable gives the default; a value
the setting does not expect gives a ``RuntimeWarning`` naming the variable (once per
value) and the default, as mpi4py does with its ``MPI4PY_RC_*`` variables. A ``MPISTRAT_*``
variable that is no setting (a misspelling) gets a warning too, with the closest name. Like
the logger's, these warnings come from rank 0 only, labelled with the rank
(``MPISTRAT_LOG_ALL_RANKS=1``: from every rank). Ranks may see different values (an MPMD
launch): nothing here depends on them agreeing.

A strategy's settings (``CHECK``, ``TIMEOUT``, ``STALL_WARNING_SECONDS``, ``TIMELINE``,
``FLIGHT_RECORDS``, ``STRAGGLER_*``) are read when the strategy is created; the process's
(``ABORT_ON_EXCEPTION``, ``LOG_ALL_RANKS``, ``CUDA_AWARE``, ``DEVICE``, ``IO_HINTS``, ``LOCAL_COPIES``,
``ALLOW_SINGLETON``) when they take effect.
``docs/configuration.md`` is the table of :data:`SETTINGS`.

>>> read("MPISTRAT_STALL_WARNING_SECONDS", env={})
60.0
>>> read("MPISTRAT_TIMEOUT", env={"MPISTRAT_TIMEOUT": "off"}) is None
True
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["OTHER_NAMES", "SETTINGS", "Setting", "given", "read", "unknown_names"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(raw: str) -> bool:
    raw = raw.lower()
    if raw in _TRUE + _FALSE:
        return raw in _TRUE
    raise ValueError("1/true/yes/on or 0/false/no/off")


def _optional_flag(raw: str) -> bool | None:
    return None if raw.lower() == "auto" else _flag(raw)


def _seconds(raw: str) -> float | None:
    raw = raw.lower()
    if raw in ("off", "none", "no", "false"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value < 0:
        raise ValueError("a number of seconds, or 0/off to disable")
    return None if value == 0 or math.isinf(value) else value


def _check(raw: str) -> int | str:
    """The check's level (0, 1, 2), or ``"step"`` (level 1, repeats checked once per step)."""
    raw = raw.lower()
    if raw in ("2", "strict"):
        return 2
    if raw == "step":
        return raw
    try:
        return int(_flag(raw))
    except ValueError:
        raise ValueError("0/off, 1/on, step or strict") from None


def _count(raw: str) -> int:
    if not raw.isdigit():
        raise ValueError("a whole number >= 0")
    return int(raw)


def _milliseconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value < 0 or math.isinf(value):
        raise ValueError("milliseconds >= 0")
    return value


def _summary(raw: str) -> str:
    raw = raw.lower()
    named = {"1": "always", "on": "always", "0": "off", "no": "off", "false": "off"}.get(raw, raw)
    if named not in ("auto", "always", "off"):
        raise ValueError("auto, always or off")
    return named


def _directory(raw: str) -> str | None:
    return None if raw.lower() in ("0", "off", "no", "false") else raw  # a path keeps its case


def _hints(raw: str) -> dict[str, str]:
    hints = {}
    for item in raw.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError("comma-separated key=value MPI-IO hints")
        hints[key.strip()] = value.strip()
    return hints


def _device(raw: str) -> str:
    raw = raw.lower()
    if raw not in ("auto", "gpu", "cpu"):
        raise ValueError("auto, gpu or cpu")
    return raw


@dataclasses.dataclass(frozen=True)
class Setting:
    """One environment variable: how its value is read, its default, and what it does."""

    name: str
    parse: Callable[[str], Any]  # the stripped value; ValueError says what it expects
    default: Any
    values: str
    means: str


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "MPISTRAT_CHECK",
            _check,
            1,
            "`0`/`off`, `1`/`on`, `step`, `strict`",
            "The handshake check before every collective; `step` checks the first step call by "
            "call and every later step once; `strict` also compares the copies of "
            "the variables every-rank merge functions update.",
        ),
        Setting(
            "MPISTRAT_NATIVE",
            _flag,
            True,
            "`1`/`on`, `0`/`off`",
            "Keep `MPISTRAT_CHECK=step`'s state (each unchecked call's record) in its compiled twin "
            "where `pip install` built it (`mpistrat info` says whether); off, its Python twin.",
        ),
        Setting(
            "MPISTRAT_TIMEOUT",
            _seconds,
            1800.0,
            "seconds; `0`/`off` disables",
            "End the job when one collective waits this long (a rank stopped for good). Set "
            "explicitly, the waiting ranks raise `CollectiveTimeoutError` first.",
        ),
        Setting(
            "MPISTRAT_STALL_WARNING_SECONDS",
            _seconds,
            60.0,
            "seconds; `0`/`off` disables",
            "Warn once, naming the missing ranks, when a collective waits this long.",
        ),
        Setting(
            "MPISTRAT_TIMELINE",
            _directory,
            None,
            "a directory; unset or `off`: no timeline",
            "Each rank writes its collectives and `mpistrat.trace` spans there "
            "(`mpistrat timeline DIR` merges them into one trace).",
        ),
        Setting(
            "MPISTRAT_FLIGHT_RECORDS",
            _count,
            8,
            "a whole number",
            "Collectives each rank remembers and shows in stall warnings, timeouts and aborts.",
        ),
        Setting(
            "MPISTRAT_STRAGGLER_SUMMARY",
            _summary,
            "auto",
            "`auto`, `always`, `off`",
            "The end-of-job straggler summary on rank 0: when a rank was a straggler, always, or never.",
        ),
        Setting(
            "MPISTRAT_STRAGGLER_MS",
            _milliseconds,
            5.0,
            "milliseconds",
            "Mean lateness below which no rank is called a straggler.",
        ),
        Setting(
            "MPISTRAT_ABORT_ON_EXCEPTION",
            _flag,
            True,
            "`1`/`on`, `0`/`off`",
            "An uncaught exception on one rank ends the job (`MPI_Abort`).",
        ),
        Setting(
            "MPISTRAT_LOG_ALL_RANKS",
            _flag,
            False,
            "`1`/`on`, `0`/`off`",
            "Log warnings from every rank, not only rank 0.",
        ),
        Setting(
            "MPISTRAT_CUDA_AWARE",
            _optional_flag,
            None,
            "`1`, `0`, `auto`",
            "Whether MPI may be handed device pointers; `auto` (unset) asks the MPI library.",
        ),
        Setting(
            "MPISTRAT_IO_HINTS",
            _hints,
            None,
            "`key=value,key=value`",
            "MPI-IO hints for checkpoint files (Lustre striping, ROMIO collective buffering); "
            "`CheckpointOptions(io_hints=...)` adds to them.",
        ),
        Setting(
            "MPISTRAT_LOCAL_COPIES",
            _directory,
            None,
            "a directory on each node's own storage; unset or `off`: none",
            "Keep each rank's share of the newest checkpoint there, and another node's rank's share; a "
            "restore reads them instead of the shared file when every share is there "
            "([surviving failures](fault-tolerance.md#node-local-copies-of-the-checkpoint)).",
        ),
        Setting(
            "MPISTRAT_ALLOW_SINGLETON",
            _flag,
            False,
            "`1`/`on`, `0`/`off`",
            "Let a process that MPI started alone go on although its launcher (srun, mpiexec) started "
            "several: independent one-rank tasks on purpose. Otherwise `MPIStrategy()` refuses.",
        ),
        Setting(
            "MPISTRAT_SHARED_PATHS",
            _directory,
            None,
            "directories, `:`-separated",
            "Count these as a shared file system in `mpistrat info --startup`, beside the network and "
            "parallel file systems it knows by type (NFS, Lustre, GPFS, BeeGFS, ...).",
        ),
        Setting(
            "MPISTRAT_MIN_REPLICAS",
            _count,
            1,
            "a whole number",
            "After a rank's death (Open MPI with `--with-ft ulfm`), go on only while at least this many "
            "replicas are left; below it every survivor raises `PeerFailedError` and the job ends.",
        ),
        Setting(
            "MPISTRAT_DEVICE",
            _device,
            "auto",
            "`auto`, `gpu`, `cpu`",
            "Where a rank's arrays live; `gpu` fails every rank if one has no GPU.",
        ),
    )
}

# MPISTRAT_* names that are not settings of the library but are used on purpose (the test suite's).
OTHER_NAMES = {"MPISTRAT_REQUIRE_GPU": "make test-gpu: the GPU tests fail instead of skipping"}

_warned: set[tuple[str, str]] = set()
_names_checked = False
# What a launcher tells each process before MPI is up: MPICH/Hydra, Open MPI, PMIx, Slurm.
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def _rank() -> int:
    """This process's ``COMM_WORLD`` rank (from the launcher's variables before MPI is up; 0 alone)."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            return int(mpi.COMM_WORLD.Get_rank())
    except Exception:  # a warning must never fail
        pass
    for variable in _RANK_VARIABLES:
        value = os.environ.get(variable, "")
        if value.isdigit():
            return int(value)
    return 0


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # mpistrat/


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised by :func:`_warn` at the caller's program: the
    innermost frame outside mpistrat (the program's ``MPIStrategy()``, not the line that reads) and
    outside the import system (a module imported on first use), whose ``_bootstrap`` frames
    ``warnings`` passes over uncounted."""
    frame: Any = sys._getframe(2)  # _warn's caller
    level = 2
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE) or _importing(frame)):
        frame = frame.f_back
        level += frame is not None and "_bootstrap" not in frame.f_code.co_filename
    return level


def _importing(frame: Any) -> bool:
    """Whether ``frame`` is the import system's (``importlib``, ``<frozen importlib._bootstrap>``)."""
    return "importlib" in frame.f_code.co_filename


def _warn(message: str) -> None:
    """A ``RuntimeWarning`` labelled with the rank, from rank 0 (every rank with MPISTRAT_LOG_ALL_RANKS)."""
    rank = _rank()
    every = os.environ.get("MPISTRAT_LOG_ALL_RANKS", "").strip().lower() in _TRUE
    if rank == 0 or every:
        warnings.warn(f"[mpistrat rank {rank}] {message}", RuntimeWarning, stacklevel=_user_stacklevel())


def unknown_names(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """``MPISTRAT_*`` names in ``env`` that are no setting, each with the closest setting's name (or None).

    >>> unknown_names({"MPISTRAT_TIMOUT": "5", "MPISTRAT_CHECK": "1", "PATH": "/bin"})
    {'MPISTRAT_TIMOUT': 'MPISTRAT_TIMEOUT'}
    """
    env = os.environ if env is None else env
    known = set(SETTINGS) | set(OTHER_NAMES)
    unknown = [name for name in sorted(env) if name.startswith("MPISTRAT_") and name not in known]
    if not unknown:
        return {}
    import difflib  # only to name the closest setting to a misspelled one

    return {
        name: next(iter(difflib.get_close_matches(name, list(SETTINGS), n=1, cutoff=0.75)), None)
        for name in unknown
    }


def _check_names() -> None:
    """Warn once per process about misspelled ``MPISTRAT_*`` names in the environment."""
    global _names_checked
    if _names_checked:
        return
    _names_checked = True
    for name, close in unknown_names().items():
        hint = f"; did you mean {close}?" if close else "; the settings are in docs/configuration.md"
        _warn(f"{name} is not an mpistrat setting and is ignored{hint}")


def read(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of setting ``name`` in ``env`` (default ``os.environ``), by the rule above."""
    setting = SETTINGS[name]
    if env is None:
        _check_names()
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return setting.default
    try:
        return setting.parse(raw)
    except ValueError as exc:
        if (name, raw) not in _warned:
            _warned.add((name, raw))
            _warn(f"{name}={raw!r} is not {exc}; using the default, {_shown(setting.default)}")
        return setting.default


def given(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``name`` is set to a value the setting accepts (not left to its default)."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return False
    try:
        SETTINGS[name].parse(raw)
    except ValueError:
        return False
    return True


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    return f"{value:g}" if isinstance(value, float) else str(value)
