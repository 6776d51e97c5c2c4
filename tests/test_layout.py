"""The tools in ``mpistrat/tools`` depend on the library, never the reverse (``python -m mpistrat``,
the command line in front of them, may import them)."""

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
        if PACKAGE / "tools" in path.parents or path == PACKAGE / "__main__.py":
            continue  # __main__ is the command line: it dispatches to the tools
        for name in _imported(ast.parse(path.read_text(), str(path))):
            if name.startswith("mpistrat.tools") or name.startswith("<relative>.tools"):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}: {name}")
    assert offenders == [], "the library imports the tools"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """The mpistrat modules a file imports when it runs (anywhere but under ``if TYPE_CHECKING``)."""
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from package import module`` imports the module (and the package's __init__,
            # which only re-exports); ``from module import name`` imports the module.
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            candidates = [m for m in submodules if m in modules] or [node.module]
        else:
            continue
        found |= {name for name in candidates if name in modules}
    return found


def test_no_import_cycle():
    """Data flows down docs/internals.md's layer map: no module imports, even lazily, one that
    imports it back (the package's __init__ files, which only re-export, aside)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    graph = {
        name: runtime_imports(ast.parse(path.read_text(), str(path)), modules) - {name}
        for name, path in paths.items()
        if path.name != "__init__.py" or "collectives" in path.parts
    }
    graph = {name: {d for d in deps if d in graph} for name, deps in graph.items()}
    cycles, done, stack = [], set(), []

    def visit(name: str) -> None:
        if name in stack:
            cycles.append(" -> ".join([*stack[stack.index(name) :], name]))
            return
        if name in done:
            return
        stack.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        stack.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    assert cycles == [], "\n".join(cycles)
