"""A type checker sees the public names of mpistrat (imported on first use, ``mpistrat/__init__.pyi``
lists them) and the public namespaces that live in layer folders under their public names:
``mpistrat.optimizers``, ``.metrics``, ``.cluster_resolver`` and ``.preemption`` are set up at run time
(``mpistrat/__init__.py``), and the stubs beside it say so to mypy. The reference is mypy itself:
each name must come out as its class, not ``Any`` or an unknown module."""

import importlib

import pytest

import mpistrat

api = pytest.importorskip("mypy.api", reason="mypy is in the dev extra")

pytestmark = [pytest.mark.serial("runs mypy over a file, once"), pytest.mark.slow]

NAMES = {
    "optimizers": "SGD",
    "metrics": "Mean",
    "cluster_resolver": "SlurmClusterResolver",
    "preemption": "TerminationConfig",
}


# Public names of mpistrat itself, imported on first use at run time (mpistrat/__init__.py), typed by
# mpistrat/__init__.pyi; and tf's experimental names, some of them imported on first use too.
TOP = {"": ["MPIStrategy", "Checkpoint", "ArrayDataset"], "experimental.": ["PreemptionWatcher"]}


def test_the_public_namespaces_type_as_their_classes(tmp_path):
    program = tmp_path / "port.py"
    lines = ["import mpistrat"] + [f"from mpistrat.{module} import {name}" for module, name in NAMES.items()]
    lines += [f"reveal_type({name})" for name in NAMES.values()]
    lines += [f"reveal_type(mpistrat.{where}{name})" for where, names in TOP.items() for name in names]
    program.write_text("\n".join(lines) + "\n")
    out, err, _ = api.run(
        [str(program), "--no-incremental", "--follow-imports=silent", "--ignore-missing-imports"]
    )
    assert "error" not in out.replace("note:", ""), out + err
    for module, name in NAMES.items():
        cls = getattr(importlib.import_module(f"mpistrat.{module}"), name)  # what the name is at run time
        assert f'-> {cls.__module__}.{name}"' in out, f"mypy does not see mpistrat.{module}.{name}: {out}"
    for where, names in TOP.items():
        for name in names:
            cls = getattr(importlib.import_module(f"mpistrat.{where}".rstrip(".")), name)
            assert f'-> {cls.__module__}.{name}"' in out, f"mypy does not see mpistrat.{where}{name}: {out}"
    assert mpistrat.optimizers.SGD is importlib.import_module("mpistrat.training.optimizers").SGD
