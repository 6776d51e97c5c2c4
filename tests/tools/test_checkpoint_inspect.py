"""``mpistrat checkpoint inspect``: what a file holds, checked against what was saved and against the
crc32c wheel (zlib for files of earlier versions)."""

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import crc32c
import numpy as np
import pytest

import mpistrat
from mpistrat.tools import checkpoint_inspect
from tests.support.launch import job_environment

pytestmark = pytest.mark.serial("reads files with one process: nothing here depends on the number of ranks")


@pytest.fixture
def saved(tmp_path):
    w = mpistrat.Variable(np.arange(12, dtype=np.float32).reshape(3, 4), name="w")
    step = mpistrat.Variable(np.int64(4), name="step")
    ckpt = mpistrat.Checkpoint(model={"w": w}, step=step)
    ckpt.save(tmp_path / "ckpt")
    return Path(ckpt.save(tmp_path / "ckpt")), w


def test_inspect_lists_the_entries_and_checks_every_checksum(saved, capsys):
    path, w = saved
    assert checkpoint_inspect.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    crc = f"{crc32c.crc32c(w.numpy().tobytes()):08x}"
    assert "format 2" in out and "saved by 1 rank(s), save_counter 2" in out
    assert any(line.split() == ["model/w", "float32", "(3,", "4)", "48", crc] for line in out.splitlines()), (
        out
    )
    assert "checksums: all 2 entries intact" in out


def test_a_flipped_byte_is_named_and_fails(saved, capsys):
    path, _ = saved
    data = bytearray(path.read_bytes())
    data[-30] ^= 0x01  # inside model/w (48 bytes), before the 8 of step
    path.write_bytes(bytes(data))
    assert checkpoint_inspect.main(["inspect", str(path)]) == 1
    assert "CHECKSUM MISMATCH in 1 entries: model/w" in capsys.readouterr().out
    assert checkpoint_inspect.main(["inspect", str(path), "--no-verify"]) == 0


def test_json_and_a_directory_means_its_latest(saved, capsys):
    path, _ = saved
    assert checkpoint_inspect.main(["inspect", str(path.parent), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == str(path) and info["save_counter"] == 2 and info["mismatched"] == []
    assert [(e["name"], e["shape"], e["dtype"]) for e in info["entries"]] == [
        ("model/w", [3, 4], "float32"),
        ("step", [], "int64"),
    ]


def test_unreadable_files_exit_2_with_one_line(tmp_path, capsys):
    (tmp_path / "junk").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    deep = b"[" * 100_000 + b"]" * 100_000  # valid JSON, deeper than Python's parser follows
    (tmp_path / "deep").write_bytes(struct.pack("<Q", len(deep)) + deep)
    assert checkpoint_inspect.main(["inspect", str(tmp_path / "junk")]) == 2
    assert checkpoint_inspect.main(["inspect", str(tmp_path / "deep")]) == 2
    assert checkpoint_inspect.main(["inspect", str(tmp_path / "missing")]) == 2
    assert checkpoint_inspect.main(["inspect", str(tmp_path)]) == 2  # a directory with no index
    err = capsys.readouterr().err.splitlines()
    assert (
        len(err) == 4
        and "truncated or corrupt" in err[0]
        and "deep is truncated or corrupt" in err[1]
        and "No such file" in err[2]
        and "no index" in err[3]
    )


def test_a_changed_header_exits_2_and_an_earlier_versions_file_says_it_has_no_header_checksum(saved, capsys):
    path, _ = saved
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"save_counter":"2"', b'"save_counter":"3"'))
    assert checkpoint_inspect.main(["inspect", str(path)]) == 2
    assert "the header's checksum differs" in capsys.readouterr().err
    earlier = Path(__file__).parents[1] / "checkpoint" / "data" / "format2" / "ckpt-1"
    assert checkpoint_inspect.main(["inspect", str(earlier), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["header_checksum"] is False
    assert checkpoint_inspect.main(["inspect", str(earlier)]) == 0
    assert "the header has no checksum of its own" in capsys.readouterr().out


@pytest.mark.parametrize("folder", ["format2", "format2-crc32", "format1"])
def test_files_of_earlier_versions_are_checked_with_their_crc32(folder, capsys, tmp_path):
    """Their entries carry zlib's CRC-32 (format 1 in its zip): listed as such, checked as intact,
    and a flipped byte of the data found."""
    path = Path(__file__).parents[1] / "checkpoint" / "data" / folder / "ckpt-1"
    assert checkpoint_inspect.main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    key = "crc32"
    assert info["checksum"] == key and info["mismatched"] == []
    if folder != "format1":
        header = int.from_bytes(path.read_bytes()[:8], "little") + 8
        first = min(info["entries"], key=lambda e: e["bytes"] == 0)
        data = path.read_bytes()
        assert int(first[key], 16) == zlib.crc32(data[header : header + first["bytes"]])
        flipped = bytearray(data)
        flipped[header] ^= 1
        (tmp_path / "flipped").write_bytes(bytes(flipped))
        assert checkpoint_inspect.main(["inspect", str(tmp_path / "flipped")]) == 1
        assert f"CHECKSUM MISMATCH in 1 entries: {first['name']}" in capsys.readouterr().out


def test_a_fifo_is_refused_with_one_line_not_waited_on(tmp_path):
    """Run as the command line runs: a FIFO opened for reading would wait for a writer forever."""
    os.mkfifo(tmp_path / "fifo")
    done = subprocess.run(
        [sys.executable, "-m", "mpistrat", "checkpoint", "inspect", str(tmp_path / "fifo")],
        env=job_environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr)
    assert f"{tmp_path / 'fifo'} is a FIFO, not a regular file" in lines[0], lines


def test_a_datasets_position_is_said_as_epoch_batches_examples_and_seed(tmp_path, capsys):
    """A shuffled ArrayDataset (seed 7, batches of 8) in its second pass after 3 batches; a dataset of
    another iterable after 2 batches of 5: no seed. What the --json says is the same."""
    strategy = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
    shuffled = strategy.experimental_distribute_dataset(
        mpistrat.ArrayDataset(np.arange(40.0), 8, shuffle=True, seed=7)
    )
    plain = strategy.experimental_distribute_dataset([np.arange(5.0)] * 4)
    list(shuffled)  # the first pass, whole
    it = iter(shuffled)
    for _ in range(3):
        next(it)
    other = iter(plain)
    next(other), next(other)
    path = mpistrat.Checkpoint(data=shuffled, other=plain).save(tmp_path / "ckpt")
    assert checkpoint_inspect.main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "position of data: epoch 1, 3 batches and 24 examples taken, seed 7" in out.splitlines(), out
    said = "position of other: epoch 0, 2 batches and 10 examples taken, no seed recorded"
    assert any(line.startswith(said) for line in out.splitlines()), out
    assert checkpoint_inspect.main(["inspect", path, "--json"]) == 0
    datasets = json.loads(capsys.readouterr().out)["datasets"]
    assert datasets == {
        "data": {"epoch": 1, "batches": 3, "examples": 24, "seed": 7},
        "other": {"epoch": 0, "batches": 2, "examples": 10, "seed": None},
    }, datasets
    strategy.experimental_finalize()


def test_a_position_of_an_earlier_version_is_decoded_from_its_row(tmp_path):
    """A file of an earlier version has the row alone (the epoch in the low 32 bits of its first number,
    the examples taken in its second; or, earlier still, the epoch and the batches): inspect says the
    epoch and what was taken, and that no seed was recorded. Per-rank input: one row per rank."""
    import dataclasses

    from mpistrat.checkpoint.files import read_table
    from mpistrat.input import saved_row

    strategy = mpistrat.MPIStrategy(mpistrat.MPI.COMM_SELF)
    dist = strategy.experimental_distribute_dataset(mpistrat.ArrayDataset(np.arange(40.0), 8))
    path = mpistrat.Checkpoint(data=dist).save(tmp_path / "ckpt")
    strategy.experimental_finalize()
    row = saved_row.encode(2, 96, saved_row.Identity(order=5, length=9))
    rows = {"data": row, "old": [4, 3], "pipelines": [[1, 16], [1, 24]]}
    earlier = dataclasses.replace(read_table(path), positions=rows, datasets={})
    lines = checkpoint_inspect._text(checkpoint_inspect._describe(earlier, [])).splitlines()
    none = "no seed recorded (not shuffled, or its order is its own)"
    assert f"position of data: epoch 2, 96 examples taken, {none}" in lines, lines
    assert f"position of old: epoch 4, 3 batches taken, {none}" in lines, lines
    assert (
        f"position of pipelines: rank 0: epoch 1, 16 batches taken, {none}; "
        f"rank 1: epoch 1, 24 batches taken, {none}"
    ) in lines, lines
