"""``mpistrat stage``: a pack of this environment, unpacked elsewhere, runs from its copy alone.

The reference is the kernel: under ``strace`` the staged ranks' file system calls are read back,
and none may touch the original environment (its prefix, its base interpreter, the editable
source tree). The two-node and Slurm cases are in tests/nodes/test_stage_nodes.py and
tests/slurm/run.sh.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpistrat.tools import stage
from tests.support import staged
from tests.support.launch import ROOT, job_environment
from tests.tools.test_bench import mpiexec

pytestmark = [pytest.mark.serial("packs this environment and starts its own jobs"), pytest.mark.slow]

ORIGINAL = [sys.prefix, sys.base_prefix, str(ROOT / "mpistrat")]  # what a staged rank must not read
# Each rank's sum and where it read Python, numpy, mpi4py and mpistrat from, in a file of its own.
REPORT = (
    "import json, sys, numpy, mpi4py.MPI, mpistrat; s = mpistrat.MPIStrategy(); "
    "r = s.run(lambda: mpistrat.get_replica_context().all_reduce('sum', numpy.ones(2))); "
    "paths = [sys.prefix, sys.base_prefix, mpistrat.__file__, numpy.__file__, mpi4py.MPI.__file__]; "
    "json.dump([r.tolist(), paths], open(f'rank-{s.extended.rank}.json', 'w'))"
)


@pytest.fixture(scope="module")
def unpacked() -> Iterator[Path]:
    """This environment's pack, unpacked into a directory of its own (as a node's /dev/shm)."""
    memory = Path("/dev/shm")
    directory = Path(tempfile.mkdtemp(dir=memory if memory.is_dir() else None)) / "stage"
    done = subprocess.run(
        [sys.executable, "-m", "mpistrat", "stage", "--unpack", str(staged.pack()), str(directory)],
        env=job_environment({"MPI4PY_RC_INITIALIZE": "0"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == str(directory / "venv" / "bin" / "python"), done
    yield directory
    shutil.rmtree(directory.parent)


def staged_env(**extra: str) -> dict[str, str]:
    """A job's environment with nothing that points back at the repository (PYTHONPATH)."""
    env = job_environment(extra)
    env.pop("PYTHONPATH", None)
    return env


def test_staged_ranks_import_everything_from_the_staged_copy(unpacked, tmp_path):
    python = unpacked / "venv" / "bin" / "python"
    trace = tmp_path / "trace"
    command = [*mpiexec(), "-n", "2", str(python), "-c", REPORT]
    if shutil.which("strace"):
        command = ["strace", "-f", "-qq", "-e", "trace=%file", "-o", str(trace), *command]
    done = subprocess.run(
        command, env=staged_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        total, paths = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert total == [2.0, 2.0]
        assert paths[0] == str(unpacked / "venv") and paths[1] == str(unpacked / "base"), paths
        assert all(p.startswith(str(unpacked) + "/") for p in paths[2:]), paths
    if not trace.exists():
        return  # no strace here: the paths above are the check
    ranks = _rank_lines(trace.read_text(errors="replace"), str(python))
    assert len(ranks) == 2
    for pid, calls in ranks.items():
        outside = [c for c in calls if any(f'"{p}/' in c or f'"{p}"' in c for p in ORIGINAL)]
        assert outside == [], f"staged rank {pid} read the original environment: {outside[:10]}"


def _rank_lines(text: str, python: str) -> dict[str, list[str]]:
    """Each staged rank's lines of an ``strace -f`` output (the processes that executed ``python``)."""
    pids = {line.split()[0] for line in text.splitlines() if f'execve("{python}"' in line}
    return {pid: [line for line in text.splitlines() if line.split(" ", 1)[0] == pid] for pid in pids}


def test_the_staged_copy_knows_it_is_staged_and_its_scripts_run_its_python(unpacked, tmp_path):
    """`mpistrat info --startup` through the staged venv's own `mpistrat` script (its #! rewritten):
    staged, from the original prefix; no hint although the original counts as shared."""
    script = unpacked / "venv" / "bin" / "mpistrat"
    assert script.read_bytes().startswith(stage.TRAMPOLINE)
    done = subprocess.run(
        [str(script), "info", "--startup", "--json", "--no-trace"],
        env=staged_env(MPISTRAT_SHARED_PATHS=sys.prefix),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    env = info["ranks"][0]["environment"]
    assert env["prefix"]["path"] == str(unpacked / "venv") and env["staged"]["prefix"] == sys.prefix
    assert env["staged"]["unpacked"] == str(unpacked) and info["hint"] is None


def test_editable_sources_are_packed_compiled_without_their_hook(unpacked):
    site = unpacked / "venv" / "lib" / "python{}.{}".format(*sys.version_info[:2]) / "site-packages"
    names = {str(p.relative_to(site)) for p in site.rglob("*")}
    sources = [p.relative_to(ROOT) for p in (ROOT / "mpistrat").rglob("*.py") if "__pycache__" not in p.parts]
    assert {str(p) for p in sources} <= names
    tag = sys.implementation.cache_tag
    assert {f"{p.parent}/__pycache__/{p.stem}.{tag}.pyc" for p in sources} <= names
    assert not [n for n in names if Path(n).name.startswith("__editable__")]


def test_a_pack_is_stale_once_the_environment_changes(tmp_path, monkeypatch):
    """The fingerprint sees an edit of an editable source (a package here, mapped by a stand-in hook)."""
    assert stage.stale(str(staged.pack())) is None  # the real pack, of this environment as it is
    assert "is no pack" in stage.stale(str(tmp_path / "missing.tar"))
    source = tmp_path / "pkg"
    source.mkdir()
    (source / "mod.py").write_text("x = 1\n")
    monkeypatch.setattr(stage, "editable_sources", lambda: {"pkg": str(source)})
    before = stage.fingerprint([])
    assert stage.fingerprint([]) == before and stage.fingerprint(["x*"]) != before
    os.utime(source / "mod.py", ns=(0, 1_000_000_000))
    assert stage.fingerprint([]) != before


def test_what_cannot_be_staged_is_refused_with_the_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)
    assert stage.main(["--pack", "-o", str(tmp_path / "p.tar")]) == 2
    assert "is not a virtual environment's python" in capsys.readouterr().err
    (tmp_path / "bad.tar").write_bytes(b"not a tar file")
    assert stage.main(["--unpack", str(tmp_path / "bad.tar"), str(tmp_path / "d")]) == 2
    assert "cannot unpack" in capsys.readouterr().err and not (tmp_path / "d").exists()
