"""The layer table of docs/internals.md holds for every import in the package.

A module imports only from its own folder (the vocabulary: its own row) and from the rows
below it, never from a peer folder of its row or from a row above. Every import counts: one
inside a function, and a type-only one under ``if TYPE_CHECKING:``. What an import graph cannot
show is checked from the syntax tree too: below ``distribute/`` a strategy's ``extended`` is used
only through its protocol, and private attributes are read across modules only where an allowance
says why.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from mpistrat.interface.protocols import StrategyExtendedProtocol

PACKAGE = Path(__file__).resolve().parent.parent / "mpistrat"
ROOT = PACKAGE.parent

pytestmark = pytest.mark.serial("reads only the source: one pass proves it")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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
    """The mpistrat modules ``path`` imports, type-only imports (under TYPE_CHECKING) included."""
    return imports_in(ast.parse(path.read_text(), str(path)))


def imports_in(tree: ast.AST, runtime: bool = False) -> set[str]:
    """The mpistrat modules a syntax tree imports, wherever the import is (``runtime``: those it
    imports when it runs, anywhere but under ``if TYPE_CHECKING:``)."""
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if runtime and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from package import module`` imports the module; ``from module import name`` the module
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            candidates = [m for m in submodules if m in MODULES] or [node.module]
        else:
            continue
        found |= {name for name in candidates if name in MODULES}
    return found


def extended_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Each member read of a strategy's ``extended`` in a syntax tree, as (line, member): read off
    ``x.extended`` itself, or off a name it was given (``extended = strategy.extended``, which may
    be handed on: ``self._extended = extended``)."""
    bound: list[tuple[ast.expr, ast.expr]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    bound += zip(target.elts, node.value.elts, strict=False)
                else:
                    bound.append((target, node.value))
    names: set[str] = set()

    def is_extended(expr: ast.expr) -> bool:
        return (isinstance(expr, ast.Attribute) and expr.attr == "extended") or ast.unparse(expr) in names

    while True:  # names given the object, and the names they hand it on to
        more = {ast.unparse(target) for target, value in bound if is_extended(value)} - names
        if not more:
            break
        names |= more
    return sorted(
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and is_extended(node.value)
    )


def below_distribute() -> list[Path]:
    """The modules of the rows below ``distribute/``'s."""
    rows = layer_table()
    first = rows.index(next(r for r in rows if "distribute/" in r)) + 1
    units = [unit for row in rows[first:] for unit in row]
    return sorted(
        path
        for unit in units
        for path in ((PACKAGE / unit).rglob("*.py") if unit.endswith("/") else [PACKAGE / f"{unit}.py"])
    )


def test_the_table_names_every_folder_and_top_level_module_once():
    units = [unit for row in layer_table() for unit in row]
    on_disk = {p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    on_disk |= {p.stem for p in PACKAGE.glob("*.py")}
    assert sorted(units) == sorted(on_disk)


def test_at_most_twelve_modules_sit_at_the_top_level():
    assert len(list(PACKAGE.glob("*.py"))) <= 12


# The modules, and the stubs whose imports a package's __init__ makes on first use (mpistrat/__init__.pyi).
CHECKED = sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("__init__.pyi")])


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(PACKAGE)))
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
    """Not even in an annotation: the layers below see a strategy through ``mpistrat.interface.protocols``."""
    offenders = []
    for path in below_distribute():
        for imported in imports_of(path):
            if imported.startswith("mpistrat.distribute"):
                offenders.append(f"{path.relative_to(ROOT)}: {imported}")
    assert offenders == []


def test_outside_distribute_a_strategys_extended_is_used_only_through_its_protocol():
    """``strategy.extended`` is duck-typed: an import graph cannot see what is used of it. A module
    of the library that does not import ``distribute/`` (``input/``, ``interface/``, ``training/``,
    ``checkpoint/``) uses only what ``StrategyExtendedProtocol`` names (mypy checks the annotated
    code; this, every use). Tools and examples are programs: they use the public classes."""
    members = {name for name in vars(StrategyExtendedProtocol) if not name.startswith("_")}
    outside = [
        path
        for path in PACKAGE.rglob("*.py")
        if not any(imported.startswith("mpistrat.distribute") for imported in imports_of(path))
        and path.relative_to(PACKAGE).parts[0] not in ("distribute", "tools", "examples")  # programs
    ]
    uses = {
        (str(path.relative_to(PACKAGE)), line, member)
        for path in outside
        for line, member in extended_uses(ast.parse(path.read_text(), str(path)))
    }
    assert {path.split("/")[0] for path, _, _ in uses} >= {"interface", "training", "checkpoint"}
    assert sorted(use for use in uses if use[2] not in members) == []


def test_the_checks_see_type_only_imports_and_reach_ins():
    """What the checks above are for is caught (a check that cannot fail proves nothing)."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from mpistrat.distribute import strategy\n"
        "def collectives_of(s):\n"
        "    extended, other = s.extended, 1\n"
        "    kept = extended\n"
        "    return s.extended.collectives, kept.update, extended.size\n"
    )
    assert imports_in(tree) == {"mpistrat.distribute.strategy"}
    assert imports_in(tree, runtime=True) == set()
    assert extended_uses(tree) == [(7, "collectives"), (7, "size"), (7, "update")]
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_library_does_not_import_the_tools():
    """``python -m mpistrat`` (``__main__``, the command line) dispatches to the tools; nothing
    else of the library imports them."""
    offenders = [
        f"{path.relative_to(ROOT)}: {imported}"
        for path in PACKAGE.rglob("*.py")
        if PACKAGE / "tools" not in path.parents and path != PACKAGE / "__main__.py"
        for imported in imports_of(path)
        if unit_of(imported) == "tools/"
    ]
    assert offenders == [], "the library imports the tools"


def test_no_import_cycle():
    """Data flows down the layer table: no module imports, even lazily, one that imports it back
    (the package's __init__ files, which only re-export, aside)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {
        name: imports_in(ast.parse(path.read_text(), str(path)), runtime=True) - {name}
        for name, path in paths.items()
        if path.name != "__init__.py" or "collectives" in path.parts
    }
    graph = {name: {d for d in deps if d in graph} for name, deps in graph.items()}
    assert circles(graph) == []


def test_type_only_imports_make_no_circle_between_folders():
    """Counting type-only imports, no chain of imports leaves a folder (or a vocabulary module) and
    comes back to it: across folders that would be an arrow up."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        here = unit_of(module_name(path))
        graph.setdefault(here, set()).update(
            there for imported in imports_of(path) if (there := unit_of(imported)) != here
        )
    graph.pop("__init__", None)  # the public face imports everything and nothing imports it
    for deps in graph.values():
        deps.discard("__init__")
    assert circles(graph) == []


# Modules that name each other in annotations inside one folder, and why they still do.
KNOWN_CIRCLES = [
    # A Strategy holds its StrategyExtended and replica contexts, which hold it back (tf's design);
    # the merge and in-turn helpers are handed the strategy that calls them.
    [
        "mpistrat.distribute.extended",
        "mpistrat.distribute.in_turn",
        "mpistrat.distribute.merge",
        "mpistrat.distribute.reductions",
        "mpistrat.distribute.replica_context",
        "mpistrat.distribute.strategy_base",
    ],
]


def test_type_only_imports_make_no_circle_between_modules_but_the_known_ones():
    """Inside a folder too, modules import in one direction, type-only imports counted (a
    protocol beside the module that needs it names what it uses), but for ``KNOWN_CIRCLES``."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {
        name: imports_of(path) - {name}
        for name, path in paths.items()
        if path.name != "__init__.py" or "collectives" in path.parts  # the others only re-export
    }
    graph = {name: {d for d in deps if d in graph} for name, deps in graph.items()}
    assert sorted(circles(graph)) == sorted(KNOWN_CIRCLES)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one node, each sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_is_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert long == {}


# -- private attributes read across modules ---------------------------------------------------

# The reach-ins left, each with why: (module, the expression as ast.unparse writes it) -> reason.
ALLOWED_REACH_INS: dict[tuple[str, str], str] = {
    ("distribute/in_turn.py", "self.context._in_turn"): "strategy.run inside a root-mode merge_fn "
    "makes a ReplicaContext whose merge_call runs in turn on rank 0: the one caller that sets it, "
    "kept off the public constructor of tf's ReplicaContext",
    ("input/source.py", "self._arrays._opened_pass"): "a Source reading an ArrayDataset opens that "
    "dataset's pass at the position they share: one reader split over two files, kept off the public "
    "ArrayDataset",
    ("training/optimizer_state.py", "local_variable(var)._value"): "the gradient check reads every "
    "variable's array at every step: the attribute itself costs half of the local_array property "
    "(30 ns against 62 a read), and the step must cost no more than the loop a user would write",
    ("training/loss_scale.py", "self.inner_optimizer._apply"): "a LossScaleOptimizer runs its inner "
    "optimizer's step with the scale dividing the summed gradient and learns whether the step was "
    "skipped (as Keras's wraps its inner optimizer's apply): kept off the optimizers' public API",
}
STDLIB_MODULES = {"sys", "os"}  # sys._getframe, os._exit: documented, and the only way to do it
ACCESSORS = {"getattr", "setattr", "hasattr"}


def class_names(cls: ast.ClassDef) -> set[str]:
    """The names a class defines: its methods and class variables, the attributes its methods set on
    ``self`` (or ``cls``) and those it lists in ``__slots__``."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets) and node.value:
                names |= {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
    for node in ast.walk(cls):
        store = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        if store and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
    return names


def typed_names(scope: ast.AST, classes: set[str]) -> dict[str, str]:
    """The names in a function (or a class body) whose class the syntax shows, when it is one of
    ``classes``: ``x: C`` (a parameter, a variable), ``x = C(...)``, ``x = object.__new__(C)``,
    ``isinstance(x, C)``."""

    def named(node: ast.AST | None) -> str | None:
        text = node.value if isinstance(node, ast.Constant) else ast.unparse(node) if node else None
        return text if text in classes else None

    typed = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.arg) and named(node.annotation):
            typed[node.arg] = named(node.annotation)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and named(node.annotation):
            typed[node.target.id] = named(node.annotation)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            made = named(call.func) or (
                named(call.args[0]) if ast.unparse(call.func).endswith("__new__") and call.args else None
            )
            typed.update((t.id, made) for t in node.targets if isinstance(t, ast.Name) and made)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and len(node.args) == 2:
            checked, kind = node.args
            if isinstance(checked, ast.Name) and named(kind):
                typed[checked.id] = named(kind)
    return typed


def private_reach_ins(tree: ast.AST, elsewhere: frozenset[str] = frozenset()) -> list[str]:
    """Each read or write of a private attribute that belongs to another module: ``x._name``,
    ``getattr(x, "_name")``, ``attrgetter("_name")``, and each ``from module import _name``.

    A private attribute is this module's where the syntax shows it: ``self._name`` (or ``cls._name``)
    in a class, ``other._name`` in a class that defines ``_name`` (another instance of it), and
    ``x._name`` where ``x`` is seen to be one of this module's classes that defines ``_name`` (see
    :func:`typed_names`), or where only this module's classes define ``_name`` (``elsewhere``: the
    names other modules' classes define). A name the module shares with another proves nothing (the
    syntax tree has no types): a read it cannot place counts as a reach-in.
    """
    classes = {cls.name: cls for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)}
    scopes: dict[int, tuple[ast.ClassDef | None, dict[str, str]]] = {}  # node -> (class, typed names)
    for scope in ast.walk(tree):  # outer scopes first: an inner one overrides
        if isinstance(scope, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            outer_class, outer_types = scopes.get(id(scope), (None, {}))
            here = scope if isinstance(scope, ast.ClassDef) else outer_class
            typed = {**outer_types, **typed_names(scope, set(classes))}
            scopes.update((id(node), (here, typed)) for node in ast.walk(scope) if node is not scope)

    def owned(cls: ast.ClassDef | None, seen: frozenset[str] = frozenset()) -> set[str]:
        if cls is None or cls.name in seen:
            return set()
        bases = [classes.get(b.id) for b in cls.bases if isinstance(b, ast.Name)]
        return class_names(cls).union(*(owned(b, seen | {cls.name}) for b in bases))

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [ast.unparse(node) for alias in node.names if private(alias.name)]
            continue
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("attrgetter", "operator.attrgetter")
            and any(isinstance(a, ast.Constant) and private(str(a.value)) for a in node.args)
        ):
            found.append(ast.unparse(node))
            continue
        if isinstance(node, ast.Attribute):
            receiver, name = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ACCESSORS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            receiver, name = node.args[0], node.args[1].value
        else:
            continue
        if not private(name) or (isinstance(receiver, ast.Name) and receiver.id in STDLIB_MODULES):
            continue
        cls, typed = scopes.get(id(node), (None, {}))
        receiver_name = receiver.id if isinstance(receiver, ast.Name) else None
        if cls is not None and (receiver_name in ("self", "cls") or name in owned(cls)):
            continue
        if receiver_name in typed and name in owned(classes[typed[receiver_name]]):
            continue
        if name not in elsewhere and any(name in class_names(c) for c in classes.values()):
            continue
        found.append(ast.unparse(node))
    return found


def test_private_attributes_are_read_across_modules_only_where_an_allowance_says_why():
    trees = {str(p.relative_to(PACKAGE)): ast.parse(p.read_text(), str(p)) for p in PACKAGE.rglob("*.py")}
    defined = {
        module: set().union(*(class_names(c) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)))
        for module, tree in trees.items()
    }
    found = {
        (module, expression)
        for module, tree in trees.items()
        for expression in private_reach_ins(
            tree, frozenset().union(*(names for other, names in defined.items() if other != module))
        )
    }
    assert sorted(found - set(ALLOWED_REACH_INS)) == []
    assert sorted(set(ALLOWED_REACH_INS) - found) == [], "an allowance no longer needed"
    assert len(ALLOWED_REACH_INS) <= 5


def test_the_reach_in_count_sees_reads_writes_and_getattr():
    tree = ast.parse(
        "from operator import attrgetter\n"
        "from mpistrat.other import _helper, public\n"
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._own = 1\n"
        "    def read(self, other, var: 'Mine'):\n"
        "        return self._own + other._own + other._theirs + self._base + var._own\n"
        "def f(var, mine: Mine):\n"
        "    var._value = getattr(var, '_key', 0) + sys._getframe(0).f_lineno + mine._own\n"
        "    return var._own, attrgetter('_value'), attrgetter('value')\n"
    )
    assert sorted(private_reach_ins(tree, elsewhere=frozenset({"_own"}))) == [
        "attrgetter('_value')",
        "from mpistrat.other import _helper, public",
        "getattr(var, '_key', 0)",
        "other._theirs",
        "var._own",  # f's var: a name Mine defines, but nothing says var is a Mine
        "var._value",
    ]
    assert "var._own" not in private_reach_ins(tree)  # no other module's class defines _own
