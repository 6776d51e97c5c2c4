"""The scripts in ``jobs/`` parse, and stay correct on the bash of older clusters.

``make test-slurm`` runs them on a real Slurm; these checks need no Slurm. Bash before 4.4
(CentOS 7 has 4.2) calls an empty array an unbound variable under ``set -u``, so an array read
from the environment (``read -r -a args <<< "$BENCH_ARGS"``), empty whenever the variable is,
must be expanded as ``${args[@]+"${args[@]}"}``.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOBS = sorted((ROOT / "jobs").glob("*.s*"))

pytestmark = pytest.mark.serial("reads files only")


def test_there_are_job_scripts():
    assert {p.name for p in JOBS} >= {"bench.sbatch", "collect.sbatch", "scaling.sh", "train.sbatch"}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", JOBS, ids=lambda p: p.name)
def test_the_script_parses(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("script", JOBS, ids=lambda p: p.name)
def test_arrays_read_from_the_environment_are_expanded_guarded(script):
    text = script.read_text()
    read = set(re.findall(r"read -r -a (\w+)", text))
    code = "\n".join(line.split(" #")[0] for line in text.splitlines() if not line.lstrip().startswith("#"))
    bare = []
    for name in read:
        guarded = f'${{{name}[@]+"${{{name}[@]}}"}}'
        rest = code.replace(guarded, "")
        bare += [m.group(0) for m in re.finditer(rf"\$\{{{name}\[[@*]\]\}}", rest)]
    assert bare == [], f'{script.name}: expand these as ${{a[@]+"${{a[@]}}"}} (bash < 4.4 with set -u)'


@pytest.mark.parametrize("script", [p for p in JOBS if p.suffix == ".sbatch"], ids=lambda p: p.name)
def test_slurms_log_goes_to_results_which_every_clone_has(script):
    """Slurm does not create the folder of --output: results/ is kept in every clone by its README."""
    outputs = re.findall(r"^#SBATCH --output=(\S+)", script.read_text(), re.M)
    assert outputs and all(o.startswith("results/") for o in outputs), outputs
    assert (ROOT / "results" / "README.md").is_file()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_train_says_in_one_line_that_its_python_lacks_mpistrat(tmp_path):
    """A Python without mpistrat (here: this one without its site-packages) is named in one line,
    with no traceback before it, and the job ends with status 2."""
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    bare.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}
    env.update(PYTHON=str(bare), RESULTS_DIR=str(tmp_path / "results"))
    done = subprocess.run(
        ["bash", str(ROOT / "jobs" / "train.sbatch")], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"mpistrat train: {bare} cannot import mpistrat.examples.digits; install mpistrat with its examples, "
        "or set TRAIN_MODULE"
    ], done.stderr
