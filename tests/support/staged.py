"""One pack of this test environment (``mpistrat stage --pack``), made once and kept while current.

The serial tests, the virtual nodes' and ``make test-slurm`` stage the same environment: the
pack lives in the system's temporary directory, named after the venv, and is made again only
when ``mpistrat stage`` finds it stale (a lock keeps parallel test workers from making it twice).
What no staged test imports is left out, to keep it small.

    python -c "from tests.support.staged import pack; print(pack())"
"""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.launch import ROOT, job_environment

LEFT_OUT = (
    "scipy* sklearn scikit_learn* matplotlib* mpl_toolkits contourpy* kiwisolver* fontTools fonttools* "
    "PIL pillow* cycler* mypy* mypyc *__mypyc* librt* ast_serialize* pygments* hypothesis* ruff* pip "
    "setuptools* _distutils_hack distutils-precedence.pth narwhals* joblib* threadpoolctl* "
    "sortedcontainers* jsonschema* rpds* referencing* attrs* tqdm* safetensors* babel* mkdocs* material "
    "pymdown* griffe*"
)


def pack(python: str = sys.executable) -> Path:
    """This environment's pack (the venv of ``python``), made if missing or stale."""
    prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True)
    name = hashlib.sha256(prefix.stdout.strip().encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "mpistrat-test-packs"
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.tar"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(
            [python, "-m", "mpistrat", "stage", "--pack", "-o", str(path), "--exclude", LEFT_OUT],
            cwd=ROOT,
            env=job_environment({"MPI4PY_RC_INITIALIZE": "0"}),
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    return path
