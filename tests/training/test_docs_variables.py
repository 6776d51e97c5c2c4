"""The runnable examples of docs/variables.md, run as their own jobs (serial pass only)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.test_checkpoint import ROOT, child_env
from tests.support.launch import launcher_options

pytestmark = pytest.mark.serial
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "variables.md").read_text(), re.S)


def run(tmp_path, code, n):
    script = tmp_path / "example.py"
    script.write_text(code)
    launcher = Path(sys.executable).parent / "mpiexec"
    cmd = [str(launcher), *launcher_options(), "-n", str(n), sys.executable, str(script)]
    done = subprocess.run(cmd, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_training_example_trains_and_resumes_at_another_size(tmp_path):
    want = "w = [ 1.5 -2.   0.5] b = 0.25 examples seen: 12800.0"
    assert want in run(tmp_path, BLOCKS[0], 2)
    saved = {p.name for p in (tmp_path / "checkpoints").iterdir()}
    assert saved == {"checkpoint", "ckpt-100", "ckpt-150", "ckpt-200"}  # max_to_keep=3 deleted ckpt-50
    assert want in run(tmp_path, BLOCKS[0], 3)  # resumes from ckpt-200: nothing left to train


def test_update_pattern_example(tmp_path):
    out = run(tmp_path, BLOCKS[1], 2)
    # Two ranks print; print() writes each argument separately, so their pieces may interleave.
    assert out.count("[-0.3 -0.3]") == 2 and out.count("-0.2") == 2, out
