"""The README's install and first-program sections work verbatim on a fresh clone.

The test copies the repository's files (tracked and untracked, not ignored: what a clone
holds, plus the work in progress) to a temporary folder, saves the README's Python block as
``example.py`` there, runs every ``bash`` block of "Install" and "A first program" line by line
in a shell, as a newcomer would paste them, and compares the output with the README's ``text``
block. The install comes from the package index (the registry must be reachable) into a fresh
venv, so this is slow: it is marked ``slow`` and ``network``, runs in the serial pass only,
and is bounded by a timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("Install", "A first program")


def section(text: str, title: str) -> str:
    """The body of ``## title`` up to the next heading of level 2 or 3."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^##+ |\Z)", text, re.M | re.S)
    assert match, f"README has no '## {title}' section"
    return match[1]


def blocks(body: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", body, re.M | re.S)


def test_the_readme_sections_hold_what_the_test_runs():
    text = (ROOT / "README.md").read_text()
    install, first = (section(text, title) for title in SECTIONS)
    assert blocks(install, "bash") and blocks(first, "bash") and len(blocks(first, "python")) == 1
    assert 'pip install ".[mpich' in install and "not on PyPI" in install
    assert all(line.startswith(".venv/bin/") for line in blocks(first, "bash")[0].splitlines())


def _files(destination: Path) -> None:
    """What a clone holds, with the work in progress: git's tracked and untracked, unignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def _fresh_env() -> dict[str, str]:
    """No launcher variables, no virtual environment, no PYTHONPATH: a newcomer's shell."""
    prefixes = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_", "MPI_LOCAL", "OMPI_", "MPISTRAT_", "PYTHON")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not (Path(p) / "activate").exists()
    )
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.timeout(900)
@pytest.mark.serial("builds a venv and runs mpiexec")
@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)
def test_the_readme_install_and_first_program_run_verbatim(tmp_path):
    text = (ROOT / "README.md").read_text()
    install, first = (section(text, title) for title in SECTIONS)
    clone = tmp_path / "mpistrat"
    clone.mkdir()
    _files(clone)
    (clone / "example.py").write_text(blocks(first, "python")[0])
    env = _fresh_env()
    outputs = []
    for block in blocks(install, "bash") + blocks(first, "bash"):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if not command:
                continue
            done = subprocess.run(
                ["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, timeout=600
            )
            assert done.returncode == 0, f"{command!r} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            outputs.append((command, done.stdout, done.stderr))
    # the first program's lines: whole, one per rank, as the README shows them (in any order)
    example = next(out for command, out, _ in outputs if command.endswith("example.py"))
    assert sorted(example.splitlines()) == sorted(blocks(first, "text")[0].splitlines())
    digits = next(out for command, out, _ in outputs if "mpistrat.examples.digits" in command)
    accuracy = re.search(r"test accuracy (\d\.\d+)", digits)
    assert accuracy and float(accuracy[1]) > 0.8, digits[-2000:]


def test_the_license_is_an_spdx_string_not_a_deprecated_table():
    """setuptools >= 77 warns, some 50 lines per build, about ``license = {text = ...}``."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "BSD-3-Clause"
    assert any(r.startswith("setuptools>=77") for r in project["build-system"]["requires"])
