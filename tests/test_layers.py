"""The layer table of docs/internals.md holds for every import in the package.

A module imports only from its own folder (the vocabulary: its own row) and from the rows
below it, never from a peer folder of its row or from a row above. Imports under
``if TYPE_CHECKING:`` are type-only and exempt; an import inside a function counts.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.test_layout import PACKAGE, module_name, runtime_imports

ROOT = PACKAGE.parent
MODULES = {module_name(path) for path in PACKAGE.rglob("*.py")}


def layer_table() -> list[list[str]]:
    """The rows of docs/internals.md's layer table, top to bottom: each a list of units,
    a folder (``"tools/"``) or a top-level module (``"errors"``)."""
    text = (ROOT / "docs" / "internals.md").read_text()
    section = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2] for line in section.splitlines() if line.startswith("| ") and "`" in line]
    return [re.findall(r"`([^`]+)`", row) for row in rows]


def unit_of(module: str) -> str:
    """The layer unit a dotted module belongs to: its folder under mpistrat/, or itself."""
    parts = module.split(".")[1:]  # drop "mpistrat"
    if not parts:
        return "__init__"
    return parts[0] + "/" if (PACKAGE / parts[0]).is_dir() else parts[0]


def imports_of(path: Path) -> set[str]:
    """The mpistrat modules ``path`` imports when it runs (anything not under TYPE_CHECKING)."""
    return runtime_imports(ast.parse(path.read_text(), str(path)), MODULES)


def test_the_table_names_every_folder_and_top_level_module_once():
    units = [unit for row in layer_table() for unit in row]
    on_disk = {p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    on_disk |= {p.stem for p in PACKAGE.glob("*.py")}
    assert sorted(units) == sorted(on_disk)


def test_at_most_twelve_modules_sit_at_the_top_level():
    assert len(list(PACKAGE.glob("*.py"))) <= 12


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_imports_only_its_own_layer_and_those_below(path: Path):
    rows = layer_table()
    row_of = {unit: i for i, row in enumerate(rows) for unit in row}
    vocabulary = rows[-1]
    here = unit_of(module_name(path))
    wrong = []
    for imported in sorted(imports_of(path)):
        there = unit_of(imported)
        same_unit = there == here or (here in vocabulary and there in vocabulary)
        if not same_unit and row_of[there] <= row_of[here]:
            wrong.append(
                f"{imported} ({there}: row {row_of[there] + 1}, this module's row is {row_of[here] + 1})"
            )
    assert wrong == [], f"{path.relative_to(ROOT)} imports up or across the layers: {wrong}"


def test_nothing_below_distribute_names_the_strategy():
    rows = layer_table()
    below = [
        unit for row in rows[rows.index(next(r for r in rows if "distribute/" in r)) + 1 :] for unit in row
    ]
    offenders = []
    for unit in below:
        paths = (PACKAGE / unit).rglob("*.py") if unit.endswith("/") else [PACKAGE / f"{unit}.py"]
        for path in paths:
            for imported in imports_of(path):
                if imported.startswith("mpistrat.distribute"):
                    offenders.append(f"{path.relative_to(ROOT)}: {imported}")
    assert offenders == []


def test_no_module_is_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert long == {}
