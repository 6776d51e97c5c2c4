"""Fixtures shared by the suite. Every test runs serially and under ``mpiexec -n N``.

Tests that communicate take ``group``: a strategy over COMM_WORLD, COMM_SELF or an
even/odd split of COMM_WORLD (mpi4py's habit of running each test on several
communicators), with the raw communicator its references are computed against.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import linecache
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from mpi4py import MPI

import mpistrat

WORLD = MPI.COMM_WORLD

# Scripts that tests launch under their own mpiexec: never import them here.
collect_ignore = [
    "faults",
    "nodes/jobs",
    "checkpoint/data",
]
collect_ignore_glob = ["*_job.py"]  # scripts the tests launch under mpiexec: they read sys.argv at import


@contextlib.contextmanager
def setting_warning(match: str) -> Iterator[None]:
    """A bad setting's ``RuntimeWarning`` matching ``match`` on rank 0, and none on the other ranks
    (settings warn from rank 0 only, as the logger logs; ``MPISTRAT_LOG_ALL_RANKS=1``: every rank)."""
    if WORLD.Get_rank() == 0:
        with pytest.warns(RuntimeWarning, match=match):
            yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not [w for w in caught if match in str(w.message)], [str(w.message) for w in caught]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "serial(reason): runs in the serial pass only (it starts its own mpiexec, or reads only the "
        "environment); skipped under mpiexec -n N > 1",
    )
    if WORLD.Get_rank() > 0:  # one readable report: other ranks print failures and the summary only
        config.option.verbose = -1


def pytest_collection_finish(session: pytest.Session) -> None:
    """The collected suite lives until the end: frozen, it is left out of every later collection (the
    tests' own ``gc.collect()``, the watchdog's, Python's), which then scans what tests made since."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The one way a test says "serial pass only": ``@pytest.mark.serial`` (or ``pytestmark``)."""
    if WORLD.Get_size() == 1:
        return
    for item in items:
        marker = item.get_closest_marker("serial")
        if marker is not None:
            reason = marker.args[0] if marker.args else "starts its own mpiexec"
            item.add_marker(pytest.mark.skip(reason=f"serial pass only: {reason}"))


@dataclasses.dataclass
class Group:
    name: str
    comm: MPI.Intracomm
    strategy: mpistrat.MPIStrategy

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()


def _make(name: str) -> Group:
    if name == "world":
        comm = WORLD.Dup()
    elif name == "self":
        comm = MPI.COMM_SELF.Dup()
    else:
        comm = WORLD.Split(WORLD.Get_rank() % 2, WORLD.Get_rank())
    return Group(name, comm, mpistrat.MPIStrategy(comm))


_GROUPS: dict[str, Group] = {}


@pytest.fixture(params=["world", "self", "split"], scope="session")
def group(request: pytest.FixtureRequest) -> Group:
    if request.param not in _GROUPS:
        _GROUPS[request.param] = _make(request.param)
    return _GROUPS[request.param]


@pytest.fixture(scope="session")
def world() -> Group:
    if "world" not in _GROUPS:
        _GROUPS["world"] = _make("world")
    return _GROUPS["world"]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelname, record.getMessage()))


@pytest.fixture(params=["python", "compiled"])
def step_twin(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> type:
    """Each twin of ``MPISTRAT_CHECK=step``'s state in turn (``collectives/step_check.py``): the
    strategies a test makes run it, whatever ``MPISTRAT_NATIVE`` chose at import (both run in every
    job, as CPython's Pure/Fast tests). The compiled one skips where it was not built."""
    from mpistrat.collectives import step_check

    twin = step_check.PythonStepCheck if request.param == "python" else step_check.CompiledStepCheck
    if twin is None:
        pytest.skip("the compiled twin was not built (no C compiler at install)")
    monkeypatch.setattr(step_check, "twin", twin)
    return twin


@pytest.fixture
def mpistrat_log() -> Iterator[list[tuple[str, str]]]:
    """(level, message) of every record the ``mpistrat`` logger lets through during the test."""
    logger, handler = logging.getLogger("mpistrat"), Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.messages
    logger.removeHandler(handler)
    logger.setLevel(level)


def all_ranks_agree(comm: MPI.Intracomm, ok: bool, detail: str = "") -> None:
    """Fail on every rank if the check failed on any rank (a lone failure would strand the others)."""
    results = comm.allgather((bool(ok), detail))
    bad = [(r, d) for r, (good, d) in enumerate(results) if not good]
    assert not bad, "failed on ranks " + "; ".join(f"{r}: {d}" for r, d in bad)


class RankChecks:
    """A multi-rank test's checks, failed together: each ``that(ok)`` is kept, and ``agree`` fails
    on every rank if a check failed on any rank, naming each failed check (its source, or ``what``)
    with its rank. Every check is evaluated, so a failure names all that failed, not the first.

    >>> checks = RankChecks()
    >>> checks.that(1 + 1 == 2)
    True
    >>> checks.agree(MPI.COMM_SELF, "detail")
    """

    def __init__(self) -> None:
        self.failed: list[str] = []

    def that(self, ok: Any, what: str = "") -> bool:
        if not ok:
            self.failed.append(what or _call_source(inspect.currentframe()))
        return bool(ok)

    def agree(self, comm: MPI.Intracomm, detail: str = "") -> None:
        failed = "; ".join(self.failed)
        all_ranks_agree(comm, not self.failed, f"{failed} ({detail})" if detail else failed)


def _call_source(frame: Any) -> str:
    """``file:line: source`` of the call that made ``frame`` (the test's ``checks.that(...)``)."""
    info = inspect.getframeinfo(frame.f_back, context=0)
    positions = getattr(info, "positions", None)  # Python 3.11: the call's whole span
    first = info.lineno if positions is None or positions.lineno is None else positions.lineno
    last = first if positions is None or positions.end_lineno is None else positions.end_lineno
    text = " ".join(linecache.getline(info.filename, n).strip() for n in range(first, last + 1))
    return f"{os.path.basename(info.filename)}:{first}: {text}"


def raises_on_every_rank(
    comm: MPI.Intracomm, error: type[BaseException], fn: Callable[[], Any], match: str = ""
) -> str:
    """Call ``fn`` on every rank; assert each rank raised ``error`` (with ``match`` in its message)."""
    try:
        fn()
        got, message = None, ""
    except BaseException as exc:
        got, message = type(exc), str(exc)
    ok = got is not None and issubclass(got, error) and match in message
    all_ranks_agree(
        comm, ok, f"expected {error.__name__} matching {match!r}; got {got and got.__name__}: {message}"
    )
    return message


_MODES: dict[tuple[str, str], mpistrat.MPIStrategy] = {}


def strategy_in_mode(group: Any, mode: str) -> mpistrat.MPIStrategy:
    """``group``'s strategy with ``merge_call=mode`` (created once per communicator and mode)."""
    if mode == "root":
        return group.strategy
    key = (group.name, mode)
    if key not in _MODES:
        _MODES[key] = mpistrat.MPIStrategy(group.comm, merge_call=mode)
    return _MODES[key]


def in_merge_fn(strategy: Any, merge_fn: Callable[..., Any], *args: Any) -> Any:
    """``merge_fn(strategy, *args)`` called through merge_call from every replica."""
    return strategy.run(lambda: mpistrat.get_replica_context().merge_call(merge_fn, args=args))
