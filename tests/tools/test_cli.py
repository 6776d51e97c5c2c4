"""The ``mpistrat`` command itself: usage, an unknown command, ``--version``, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import mpistrat
from mpistrat.__main__ import main
from tests.tools.test_bench import mpiexec_env


def test_an_unknown_command_says_so_and_suggests(capsys):
    assert main(["benhc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpistrat: unknown command 'benhc'; did you mean 'bench'?")
    assert "usage: mpistrat {info,bench,plot,report,timeline,stage,checkpoint}" in err


def test_usage_and_version(capsys):
    assert main(["--help"]) == 0 and "report" in capsys.readouterr().out
    assert main([]) == 2
    capsys.readouterr()
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"mpistrat {mpistrat.__version__}")


@pytest.mark.serial
@pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name != "posix", reason="POSIX signals")
def test_ctrl_c_ends_with_one_line_and_status_130():
    """SIGINT while bench runs: one line on stderr, no traceback, exit status 130 (128 + SIGINT)."""
    cmd = [sys.executable, "-m", "mpistrat", "bench", "--ops", "all_reduce", "--max", "4"]
    cmd += ["--iters", "100000000", "--quiet", "--progress"]
    with subprocess.Popen(cmd, env=mpiexec_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        try:
            assert proc.stderr is not None
            proc.stderr.read1(1)  # the progress bar's first byte: the sweep is running
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    text = err.decode().replace("\r", "\n")
    assert proc.returncode == 130, text[-2000:]
    assert "Traceback" not in text and text.rstrip().endswith("mpistrat bench: interrupted")


@pytest.mark.serial
def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path):
    """``mpistrat checkpoint inspect PATH | head``: once head has its lines, the rest of the output
    meets a closed pipe; the command ends with status 141 (128 + SIGPIPE), no traceback."""
    import numpy as np

    variables = {f"v{i:04d}": mpistrat.Variable(np.zeros(1, np.float32)) for i in range(3000)}
    path = mpistrat.Checkpoint(**variables).save(tmp_path / "ckpt")  # its listing: far over a pipe's 64 KiB
    cmd = [sys.executable, "-m", "mpistrat", "checkpoint", "inspect", path]
    with subprocess.Popen(cmd, env=mpiexec_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stdout.readline().startswith(path.encode())
        proc.stdout.close()  # as head does after its lines
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141 and err == b"", err.decode()[-2000:]
