"""What starting a job costs: ``import mpistrat`` loads only what every job needs, and each public
name is imported when first used (``mpistrat/__init__.py``, the names listed in ``__init__.pyi``).

The counts run in a fresh interpreter, where nothing was imported before; the reference for the
public names is the stub itself, its imports executed as plain Python.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mpistrat
from tests.support.launch import ROOT, job_environment

pytestmark = pytest.mark.serial("starts fresh interpreters, one rank each")

STUB = ROOT / "mpistrat" / "__init__.pyi"

# What `import mpistrat` loads, and why each: a new module here is loaded by every rank of every job.
EAGER = {
    "mpistrat": "the public face",
    "mpistrat.interface": "the package of the modes",
    "mpistrat.interface.modes": "has_strategy and its kin; __init__ registers the default strategy with it",
    "mpistrat.errors": "the modes' errors",
    "mpistrat.interface.protocols": "the protocols the modes hold",
    "mpistrat.diagnostics": "the package of abort",
    "mpistrat.diagnostics.abort": "its exit hook must come before the program's exit handlers",
    "mpistrat.diagnostics.callsite": "abort names where Ctrl-C stopped",
    "mpistrat.diagnostics.startup": "starts MPI, noting when (mpistrat info --startup)",
    "mpistrat.config": "abort reads MPISTRAT_ABORT_ON_EXCEPTION",
    "mpistrat.log": "abort labels its lines with the rank",
}
# A minimal strategy.run loads this many mpistrat modules (66 before the collectives, the update and
# merge paths, the input contexts were imported at first use): one more is a new import on every
# job's path. Raise it only for a module every job needs.
RUN_MODULES = 48
# Modules and packages a job that does not use them never loads.
UNUSED = (
    "mpistrat.checkpoint",  # until a Checkpoint is made
    "mpistrat.tools",  # never from the library
    "mpistrat.examples",
    "mpistrat.comm.cuda",  # device arrays only (CuPy)
    "mpistrat.comm.nccl",
    "mpistrat.comm.hierarchy",  # CommunicationImplementation.HIERARCHICAL only
    "mpistrat.input",  # until a dataset or a value function is distributed
    "mpistrat.distribute.cluster_resolver",  # until a resolver is asked for
    "mpistrat.distribute.updates",  # until a variable is updated
    "mpistrat.distribute.merge",  # until merge_call
    "mpistrat.distribute.in_turn",
    "mpistrat.training.optimizers",
    "mpistrat.collectives.all_gather",  # each collective at its first call
    "mpistrat.collectives.broadcast",
    "mpistrat.collectives.objects",
    "mpistrat.collectives.in_place",
    "mpistrat.collectives.reduce_axis",
    "mpistrat.collectives.failure",  # a collective that failed in MPI
    "mpistrat.collectives.mismatch",  # ranks that disagree
    "mpistrat.collectives.exact_sum",  # deterministic=True
    "mpistrat.collectives.compressed",  # compression="bf16" or "fp16"
    "mpistrat.collectives.hierarchical",
    "mpistrat.collectives.step_check",  # MPISTRAT_CHECK=step
    "mpistrat.collectives.native_step",
)
# What a minimal run does not load beyond mpistrat: optree for a single array, hashlib (OpenSSL's
# libcrypto), socket for the host name.
UNUSED_OTHERS = ("optree", "hashlib", "_hashlib", "socket")

PROBE = """
import json, sys
import numpy, mpi4py.MPI
before = set(sys.modules)
import mpistrat
imported = sorted(m for m in set(sys.modules) - before if m.startswith("mpistrat"))
strategy = mpistrat.MPIStrategy()
result = strategy.run(lambda: mpistrat.get_replica_context().all_reduce("sum", numpy.ones(2)))
strategy.reduce("sum", result, axis=None)
ran = sorted(m for m in set(sys.modules) - before if m.startswith("mpistrat"))
others = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in UNUSED_OTHERS)
print(json.dumps({"import": imported, "run": ran, "others": others}))
"""


def fresh(code: str, env: dict[str, str] | None = None) -> str:
    """What ``code`` prints in a fresh interpreter, one MPI process, from the repository root."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=job_environment(env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[str]]:
    return json.loads(fresh(PROBE.replace("UNUSED_OTHERS", repr(UNUSED_OTHERS))).splitlines()[-1])


def test_import_mpistrat_loads_only_what_every_job_needs(loaded):
    assert len(loaded["import"]) <= 30
    assert set(loaded["import"]) == set(EAGER), "a module `import mpistrat` now loads (or no longer does)"


def test_a_minimal_run_loads_no_module_it_does_not_use(loaded):
    unused = [m for m in loaded["run"] if m.startswith(UNUSED)]
    assert unused == []
    assert loaded["others"] == []
    assert len(loaded["run"]) <= RUN_MODULES, f"a minimal strategy.run loads: {loaded['run']}"


def stub_names() -> dict[str, str]:
    """Each name the stub imports, and the module its import line names."""
    tree = ast.parse(STUB.read_text())
    return {a.asname or a.name: n.module for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}


def test_every_public_name_is_the_object_the_stub_imports():
    """The reference: the stub's import lines run as plain (eager) Python."""
    tree = ast.parse(STUB.read_text())
    eager: dict[str, object] = {}
    exec(
        compile(ast.Module([n for n in tree.body if isinstance(n, ast.ImportFrom)], []), str(STUB), "exec"),
        eager,
    )
    stub_all = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign))
    assert mpistrat.__all__ == stub_all
    # a new public name is its import line and its __all__ entry, both in the stub
    assert set(stub_all) == set(stub_names()), set(stub_all) ^ set(stub_names())
    for name in stub_all:
        assert getattr(mpistrat, name) is eager[name], name
    assert set(stub_all) <= set(dir(mpistrat))
    experimental, preemption = (
        mpistrat.experimental,
        importlib.import_module("mpistrat.checkpoint.preemption"),
    )
    assert set(experimental.__all__) <= set(dir(experimental))
    for name in ("PreemptionCheckpointHandler", "PreemptionWatcher", "TerminationConfig"):
        assert getattr(experimental, name) is getattr(preemption, name)
    assert experimental.MultiWorkerMirroredStrategy is mpistrat.MultiWorkerMirroredStrategy
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        mpistrat.NoSuchName  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nosuchmodule'"):
        mpistrat.nosuchmodule  # noqa: B018
    with pytest.raises(AttributeError, match=r"Use mpistrat\.MPIStrategy"):
        mpistrat.MirroredStrategy  # noqa: B018


# The public namespaces that live in layer folders, and their homes.
NAMESPACES = {
    "optimizers": "training.optimizers",
    "metrics": "training.metrics",
    "cluster_resolver": "distribute.cluster_resolver",
    "preemption": "checkpoint.preemption",
    "optimizers.schedules": "training.schedules",
}

BEHAVIOUR = """
import importlib, sys, warnings
import numpy as np
warnings.simplefilter("always")
import mpistrat
assert "mpistrat.distribute" not in sys.modules

# A lower layer reaches the context first: the default strategy is made then. (Its import reads the
# settings: the misspelled one is named now, at this program's line.)
from mpistrat.training.variables import Variable
print("plain", type(Variable(1.0)).__name__, mpistrat.has_strategy(), type(mpistrat.get_strategy()).__name__)

strategy = mpistrat.MPIStrategy()
with strategy.scope():
    print("in scope", type(mpistrat.Variable(np.ones(2))).__name__, mpistrat.has_strategy())

print("experimental", mpistrat.experimental.CommunicationOptions is mpistrat.CommunicationOptions,
      "mpistrat.checkpoint" in sys.modules)

import mpistrat.optimizers
from mpistrat.metrics import Mean
from mpistrat.optimizers.schedules import ExponentialDecay
for public, home in NAMESPACES.items():
    module = importlib.import_module("mpistrat." + public)
    real = sys.modules["mpistrat." + home]
    attribute = importlib.import_module("operator").attrgetter(public)(mpistrat)
    print("namespace", public, module is real, attribute is real, real.__spec__.name)
same = Mean is mpistrat.metrics.Mean and ExponentialDecay is mpistrat.optimizers.schedules.ExponentialDecay
watcher = mpistrat.experimental.PreemptionWatcher is mpistrat.PreemptionWatcher
print("names", same, mpistrat.preemption.RESTART_EXIT_CODE, watcher)
print("submodule", mpistrat.comm.packing.__name__)
"""


def test_a_fresh_process_gets_every_effect_import_once_had():
    """Run in a fresh interpreter, where the lazy paths run first: the default strategy, the class a
    variable gets in a scope, the public namespaces, the configuration check and its warning."""
    out = fresh(BEHAVIOUR.replace("NAMESPACES", repr(NAMESPACES)), {"MPISTRAT_TIMOUT": "5"})
    assert "plain Variable False _DefaultStrategy" in out
    assert "in scope MirroredVariable True" in out
    assert "experimental True False" in out  # its preemption names did not load the checkpoint package
    for public, home in NAMESPACES.items():
        assert f"namespace {public} True True mpistrat.{home}\n" in out, out
    assert "names True 75 True" in out
    assert "submodule mpistrat.comm.packing" in out
    # Named once, when the settings were first read, at the program's own line: not inside mpistrat
    # or the import system, which imported the module that read them.
    assert out.count("MPISTRAT_TIMOUT is not an mpistrat setting") == 1, out
    assert re.search(r"^<string>:\d+: RuntimeWarning", out, re.MULTILINE), out


def strace_count(code: str, tmp_path: Path) -> int:
    """The file system calls (``strace -f -c -e trace=%file``) of ``python -c code``."""
    summary = tmp_path / "summary"
    done = subprocess.run(
        ["strace", "-f", "-c", "-e", "trace=%file", "-o", str(summary), sys.executable, "-c", code],
        cwd=ROOT,
        env=job_environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0 or not summary.exists():
        pytest.skip(f"strace cannot trace here (ptrace refused?): {done.stderr.strip()[-300:]}")
    return int(summary.read_text().splitlines()[-1].split()[3])  # % time, seconds, usecs/call, calls


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
def test_import_mpistrat_makes_few_file_system_calls_of_its_own(tmp_path):
    base = strace_count("import numpy, mpi4py.MPI", tmp_path)
    with_mpistrat = strace_count("import numpy, mpi4py.MPI, mpistrat", tmp_path)
    assert with_mpistrat - base <= 475, (base, with_mpistrat)


DEFERRED = """
import importlib
from mpistrat.collectives import Collectives
deferred = {n: v for n, v in vars(Collectives).items() if type(v).__name__ == "_Deferred"}
for name, method in sorted(deferred.items()):
    module = importlib.import_module("mpistrat.collectives." + method.module)
    print(name, getattr(Collectives, name) is getattr(module, {"failed_in_mpi": "from_mpi"}.get(name, name)))
"""


def test_each_deferred_collective_is_the_function_of_its_file():
    """A method imported at first use (``_Deferred``) is the function its file defines, under the
    method's own name unless renamed: a misspelt name would fail only at a job's first call."""
    out = fresh(DEFERRED).split()
    answers = dict(zip(out[::2], out[1::2], strict=True))
    assert len(answers) == 15 and set(answers.values()) == {"True"}, answers
