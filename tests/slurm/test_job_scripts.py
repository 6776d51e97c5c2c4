"""The scripts in ``jobs/`` parse, and stay correct on the bash of older clusters.

``make test-slurm`` runs them on a real Slurm; these checks need no Slurm. Bash before 4.4
(CentOS 7 has 4.2) calls an empty array an unbound variable under ``set -u``, so an array read
from the environment (``read -r -a args <<< "$BENCH_ARGS"``), empty whenever the variable is,
must be expanded as ``${args[@]+"${args[@]}"}``.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

JOBS = sorted((Path(__file__).resolve().parents[2] / "jobs").glob("*.s*"))

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
