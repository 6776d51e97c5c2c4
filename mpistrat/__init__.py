"""mpistrat: the tf.distribute programming model on MPI, for NumPy and CuPy arrays.

>>> import mpistrat, numpy as np
>>> strategy = mpistrat.MPIStrategy()
>>> def step(x):
...     ctx = mpistrat.get_replica_context()
...     return ctx.all_reduce("sum", x)
>>> total = strategy.run(step, args=(np.ones(3),))

Each public name is imported when it is first used (PEP 562), so a job loads only the parts it
uses: at ten thousand ranks every module is read from the shared file system by every rank. The
names, and the module each comes from, are listed in ``__init__.pyi`` (what type checkers read).
"""

import ast
import importlib
import importlib.machinery
import os
import sys
from pathlib import Path
from typing import Any

# Open MPI launched to survive a rank's death (--with-ft ulfm): its MPI_Finalize ends with a fence that
# was seen to hang after a death (4 times in 10); skip it, as its async_mpi_finalize option does,
# unless the launch chose. Read by MPI_Init, so before anything below can start MPI
# (docs/fault-tolerance.md).
if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes", "on"):  # noqa: SIM112
    os.environ.setdefault("OMPI_MCA_async_mpi_finalize", "1")

from mpistrat.diagnostics import startup as _startup  # starts MPI, and notes when

# Imported now, not on first use: its exit hook is registered when it is imported, so that it runs
# after the exit handlers the program registers after `import mpistrat` (atexit is LIFO).
from mpistrat.diagnostics.abort import set_abort_on_exception as set_abort_on_exception
from mpistrat.interface import modes

__version__ = "0.1.0"

# The public namespaces that live in a layer folder, importable by their public names as os.path is
# (`from mpistrat.optimizers import SGD`, as in tf.keras); a `.pyi` stub beside this file types each.
_NAMESPACES = {
    f"{__name__}.cluster_resolver": f"{__name__}.distribute.cluster_resolver",
    f"{__name__}.metrics": f"{__name__}.training.metrics",
    f"{__name__}.optimizers": f"{__name__}.training.optimizers",
    f"{__name__}.optimizers.schedules": f"{__name__}.training.schedules",
    f"{__name__}.preemption": f"{__name__}.checkpoint.preemption",
}


def _public_names() -> tuple[dict[str, tuple[str, str]], list[str]]:
    """Each name ``__init__.pyi`` imports, with its ``from`` module; and its ``__all__``."""
    tree = ast.parse(Path(__file__).with_suffix(".pyi").read_text())
    homes, names = {}, []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            homes.update({alias.asname or alias.name: (node.module, alias.name) for alias in node.names})
        elif isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            names = ast.literal_eval(node.value)
    return homes, names


_HOMES, __all__ = _public_names()

# tf's names that mpistrat has not, and what to use instead. tf's MirroredStrategy is one process
# driving every device of one machine; here a replica is an MPI rank, so the name would run a tf
# program on one replica, silently (docs/migrating.md).
_NOT_HERE = {
    "MirroredStrategy": "mpistrat has no MirroredStrategy: tf's drives every GPU of one machine from one "
    "process, mpistrat runs one replica per MPI rank. Use mpistrat.MPIStrategy() (or "
    "MultiWorkerMirroredStrategy()) and launch one rank per device: mpiexec -n <devices> python ...",
}


def __getattr__(name: str) -> Any:
    """Import a public name on first use; a submodule's name imports the submodule, as
    ``import mpistrat`` once did (``mpistrat.config``, ``mpistrat.preemption``)."""
    if name in _HOMES:
        module, attribute = _HOMES[name]
        home = importlib.import_module(module)
        if module == __name__ or not hasattr(home, attribute):  # a submodule (from package import module)
            value = importlib.import_module(f"{module}.{attribute}")
        else:
            value = getattr(home, attribute)
    elif name in _NOT_HERE:
        raise AttributeError(_NOT_HERE[name])
    elif name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})


class _Namespaces:
    """The import hook behind ``_NAMESPACES``: ``import mpistrat.optimizers`` gives the module
    ``mpistrat.training.optimizers`` itself, imported then (not when mpistrat is)."""

    @staticmethod
    def find_spec(name: str, path: Any = None, target: Any = None) -> Any:
        return importlib.machinery.ModuleSpec(name, _Namespaces) if name in _NAMESPACES else None

    @staticmethod
    def create_module(spec: Any) -> Any:
        module = importlib.import_module(_NAMESPACES[spec.name])
        spec.loader_state = module.__spec__  # the import system sets the alias's spec on it: put back
        return module

    @staticmethod
    def exec_module(module: Any) -> None:
        alias, module.__spec__ = module.__spec__.name, module.__spec__.loader_state
        for name, home in _NAMESPACES.items():  # mpistrat.optimizers.schedules: the import system looks
            if name.startswith(f"{alias}."):  # for it in sys.modules (mpistrat.optimizers is no package)
                sys.modules[name] = importlib.import_module(home)


sys.meta_path.insert(0, _Namespaces)


def _default_strategy() -> Any:
    """What the context holds outside any scope: ``distribute/default.py`` makes it, and registers
    itself with the context in its place, when first imported."""
    from mpistrat.distribute.default import default_strategy

    return default_strategy()


modes.set_default_strategy(_default_strategy)
_startup.reached("import mpistrat")
