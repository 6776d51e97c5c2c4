"""Environment settings: one reader, one rule, a warning for what it does not expect."""

import math
import re
import warnings
from pathlib import Path

import pytest

import mpistrat
from mpistrat import CollectiveMismatchError, InvalidArgumentError, config
from tests.conftest import raises_on_every_rank

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, 60.0), ("", 60.0), ("5", 5.0), (" 0.5 ", 0.5), ("0", None), ("OFF", None), ("inf", None)],
)
def test_seconds(raw, expected):
    env = {} if raw is None else {"MPISTRAT_STALL_WARNING_SECONDS": raw}
    assert config.read("MPISTRAT_STALL_WARNING_SECONDS", env) == expected


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("MPISTRAT_CHECK", "strict", 2),
        ("MPISTRAT_CHECK", "Off", 0),
        ("MPISTRAT_CHECK", "yes", 1),
        ("MPISTRAT_ABORT_ON_EXCEPTION", "no", False),
        ("MPISTRAT_LOG_ALL_RANKS", "TRUE", True),
        ("MPISTRAT_CUDA_AWARE", "auto", None),
        ("MPISTRAT_CUDA_AWARE", "0", False),
        ("MPISTRAT_DEVICE", "GPU", "gpu"),
    ],
)
def test_every_kind_of_value(name, raw, expected):
    assert config.read(name, {name: raw}) == expected
    assert config.given(name, {name: raw})


@pytest.mark.parametrize(
    ("name", "raw", "says"),
    [
        ("MPISTRAT_TIMEOUT", "ten", "a number of seconds, or 0/off to disable; using the default, 1800"),
        ("MPISTRAT_TIMEOUT", "-1", "a number of seconds"),
        ("MPISTRAT_TIMEOUT", "nan", "a number of seconds"),
        ("MPISTRAT_CHECK", "maybe", "0/off, 1/on, step or strict; using the default, 1"),
        ("MPISTRAT_DEVICE", "tpu", "auto, gpu or cpu; using the default, auto"),
        ("MPISTRAT_LOG_ALL_RANKS", "2", "1/true/yes/on or 0/false/no/off; using the default, False"),
    ],
)
def test_an_unexpected_value_warns_once_and_gives_the_default(name, raw, says, monkeypatch):
    config._warned.discard((name, raw))
    monkeypatch.setattr(config, "_rank", lambda: 0)  # rank 0 says it, whatever this process's rank
    with pytest.warns(RuntimeWarning, match=re.escape(f"[mpistrat rank 0] {name}={raw!r} is not {says}")):
        got = config.read(name, {name: raw})
    assert got == config.SETTINGS[name].default and not config.given(name, {name: raw})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.read(name, {name: raw})  # said once is enough


def test_other_ranks_stay_quiet_unless_every_rank_may_speak(monkeypatch):
    """A bad value every rank sees is said once, by rank 0; MPISTRAT_LOG_ALL_RANKS=1 lets rank 3 say it."""
    env = {"MPISTRAT_CHECK": "sometimes"}
    monkeypatch.setattr(config, "_rank", lambda: 3)
    monkeypatch.delenv("MPISTRAT_LOG_ALL_RANKS", raising=False)
    config._warned.discard(("MPISTRAT_CHECK", "sometimes"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config.read("MPISTRAT_CHECK", env) == 1
    monkeypatch.setenv("MPISTRAT_LOG_ALL_RANKS", "1")
    config._warned.discard(("MPISTRAT_CHECK", "sometimes"))
    with pytest.warns(RuntimeWarning, match=re.escape("[mpistrat rank 3] MPISTRAT_CHECK='sometimes' is not")):
        config.read("MPISTRAT_CHECK", env)


def test_a_misspelled_name_is_named_with_the_closest_setting(monkeypatch):
    assert config.unknown_names({"MPISTRAT_TIMOUT": "5", "MPISTRAT_STALL_WARNING_SECOND": "1"}) == {
        "MPISTRAT_STALL_WARNING_SECOND": "MPISTRAT_STALL_WARNING_SECONDS",
        "MPISTRAT_TIMOUT": "MPISTRAT_TIMEOUT",
    }
    assert config.unknown_names({"MPISTRAT_COLOUR": "1"}) == {"MPISTRAT_COLOUR": None}
    assert config.unknown_names({name: "1" for name in [*config.SETTINGS, *config.OTHER_NAMES]}) == {}
    monkeypatch.setenv("MPISTRAT_TIMOUT", "5")
    monkeypatch.setattr(config, "_rank", lambda: 0)
    monkeypatch.setattr(config, "_names_checked", False)
    with pytest.warns(RuntimeWarning, match="MPISTRAT_TIMOUT is not an mpistrat setting.*MPISTRAT_TIMEOUT"):
        config.read("MPISTRAT_CHECK")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.read("MPISTRAT_CHECK")  # once per process


def test_a_rank_stopped_for_good_ends_the_job_by_default():
    """No fault may leave a job running forever with default settings: the timeout is on."""
    timeout = config.read("MPISTRAT_TIMEOUT", {})
    assert timeout is not None and not math.isinf(timeout) and timeout == 1800.0


def test_the_default_timeout_is_watched_but_not_polled(world, monkeypatch):
    """Only a chosen timeout makes the handshake poll (to raise in the caller); the default
    ends the job from the watchdog thread, so the default hot path stays a blocking wait."""
    monkeypatch.delenv("MPISTRAT_TIMEOUT", raising=False)
    strategy = mpistrat.MPIStrategy(world.comm)
    monitor = strategy.extended.collectives.monitor
    assert monitor.env_timeout == 1800.0 and not monitor.env_polled
    strategy.experimental_finalize()


def test_a_bad_setting_read_inside_mpistrat_is_reported_at_the_programs_line(monkeypatch):
    """The line to change is the program's, not the library line that happened to read the setting."""
    from mpistrat.diagnostics import abort

    name, raw = "MPISTRAT_ABORT_ON_EXCEPTION", "perhaps"
    config._warned.discard((name, raw))
    monkeypatch.setattr(config, "_rank", lambda: 0)
    monkeypatch.setattr(abort, "_enabled", None)
    monkeypatch.setenv(name, raw)
    with pytest.warns(RuntimeWarning, match=f"{name}='{raw}'") as caught:
        abort.enabled()  # reads the setting inside mpistrat/diagnostics/abort.py
    assert [w.filename for w in caught] == [__file__], [(w.filename, w.lineno) for w in caught]


def test_the_docs_table_lists_every_setting_with_its_default():
    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = {m[0]: m[1] for m in re.findall(r"^\| `(MPISTRAT_\w+)` \| ([^|]+) \|", page, re.M)}
    assert set(rows) == set(config.SETTINGS), rows
    for name, setting in config.SETTINGS.items():
        assert rows[name].strip().strip("`") == config._shown(setting.default), name


def test_a_path_keeps_its_case():
    assert config.read("MPISTRAT_TIMELINE", {"MPISTRAT_TIMELINE": " /tmp/MyRun "}) == "/tmp/MyRun"
    assert config.read("MPISTRAT_TIMELINE", {"MPISTRAT_TIMELINE": "OFF"}) is None


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("other", ["0", "step"])
def test_ranks_that_would_check_differently_fail_strategy_creation_on_every_rank(world, monkeypatch, other):
    """A rank that skips the handshake (or checks a repeat only at the step's end) would strand the
    ones that send it."""
    if world.rank == world.size - 1:
        monkeypatch.setenv("MPISTRAT_CHECK", other)
    raises_on_every_rank(world.comm, CollectiveMismatchError, lambda: mpistrat.MPIStrategy(world.comm))


def test_a_timeline_directory_that_cannot_be_written_fails_every_rank(world, monkeypatch, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    if world.rank == world.size - 1:
        monkeypatch.setenv("MPISTRAT_TIMELINE", str(blocked / "timeline"))
    raises_on_every_rank(
        world.comm, InvalidArgumentError, lambda: mpistrat.MPIStrategy(world.comm), "timeline"
    )
