"""Message sizes: one reader, ``mpistrat.tools.sizes.parse_size``, behind every tool's size options."""

from __future__ import annotations

import argparse

import pytest

from mpistrat.tools import bench, bench_args, bench_gpu, plot
from mpistrat.tools.sizes import parse_size

SPELLINGS = {
    "4": 4,
    "4B": 4,
    "64K": 64 << 10,
    "64KiB": 64 << 10,
    "64kb": 64 << 10,
    "64 KiB": 64 << 10,
    "1M": 1 << 20,
    "1MB": 1 << 20,
    "1MiB": 1 << 20,
    "256mib": 256 << 20,
    "1g": 1 << 30,
    "2G": 2 << 30,
    "1GiB": 1 << 30,
}
BAD = ("", "0", "-4", "1.5M", "KiB", "4iB", "4T", "lots", "4 K B")


def test_units_are_binary_in_any_spelling():
    assert {text: parse_size(text) for text in SPELLINGS} == SPELLINGS
    assert bench.parse_size is bench_gpu.parse_size is parse_size  # one reader, re-exported


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_size_says_what_was_expected_and_what_came(bad):
    with pytest.raises(
        argparse.ArgumentTypeError, match="expected a size like 4, 64K, 64KiB, 1MB or 1g"
    ) as e:
        parse_size(bad)
    assert str(e.value).endswith(f"got {bad!r}")


# Each CLI's parser, the arguments it needs besides a size, and the option that takes the size.
CLIS = {
    "mpistrat bench": (bench_args.parser, [], ["--min", "--max", "--bytes-per-pack"]),
    "bench_gpu": (bench_gpu._parser, [], ["--min", "--max"]),
    "mpistrat plot": (plot._parser, ["results.json", "-o", "out.png"], ["--size"]),
}


@pytest.mark.parametrize("cli", CLIS)
def test_every_cli_accepts_every_spelling(cli):
    make, required, options = CLIS[cli]
    for option in options:
        for text, nbytes in SPELLINGS.items():
            args = make().parse_args([*required, option, text])
            assert getattr(args, option.lstrip("-").replace("-", "_")) == nbytes, (cli, option, text)


@pytest.mark.parametrize("cli", CLIS)
def test_every_cli_rejects_a_bad_size_naming_the_option(cli, capsys):
    make, required, options = CLIS[cli]
    with pytest.raises(SystemExit) as exit_:
        make().parse_args([*required, options[0], "1.5M"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {options[0]}: expected a size like" in err and "got '1.5M'" in err
