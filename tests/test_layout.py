"""The tools in ``mpistrat/tools`` depend on the library, never the reverse."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mpistrat"


def _imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            names |= {f"<relative>.{node.module or ''}"} | {f"<relative>.{a.name}" for a in node.names}
    return names


def test_the_library_does_not_import_the_tools():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if PACKAGE / "tools" in path.parents:
            continue
        for name in _imported(ast.parse(path.read_text(), str(path))):
            if name.startswith("mpistrat.tools") or name.startswith("<relative>.tools"):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}: {name}")
    assert offenders == [], "the library imports the tools"
