"""A type checker sees the public namespaces that live in layer folders under their public names:
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


def test_the_public_namespaces_type_as_their_classes(tmp_path):
    program = tmp_path / "port.py"
    lines = [f"from mpistrat.{module} import {name}" for module, name in NAMES.items()]
    lines += [f"reveal_type({name})" for name in NAMES.values()]
    program.write_text("\n".join(lines) + "\n")
    out, err, _ = api.run(
        [str(program), "--no-incremental", "--follow-imports=silent", "--ignore-missing-imports"]
    )
    assert "error" not in out.replace("note:", ""), out + err
    for module, name in NAMES.items():
        cls = getattr(importlib.import_module(f"mpistrat.{module}"), name)  # what the name is at run time
        assert f'-> {cls.__module__}.{name}"' in out, f"mypy does not see mpistrat.{module}.{name}: {out}"
    assert mpistrat.optimizers.SGD is importlib.import_module("mpistrat.training.optimizers").SGD
