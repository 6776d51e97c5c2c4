"""Checkpoints of variables and optimizers that survive a job killed mid-save.

Every rank calls :meth:`Checkpoint.save` and :meth:`Checkpoint.restore` (they are
collective, in cross-replica context). Rank 0 writes one ``.npz`` file atomically:
to a temporary file, ``fsync``, then ``rename``, so the previous checkpoint at that
path stays intact until the new one is complete. Sync-on-read variables are saved
aggregated; ``restore`` reads on rank 0 and broadcasts, so a checkpoint restores at
any number of ranks.

>>> import mpistrat, numpy as np, os, tempfile
>>> w = mpistrat.Variable(np.arange(3.0))
>>> ckpt = mpistrat.Checkpoint(model={"w": w})
>>> path = ckpt.save(os.path.join(tempfile.mkdtemp(), "ckpt-1"))
>>> _ = w.assign(np.zeros(3))
>>> ckpt.restore(ckpt.latest(os.path.dirname(path))) == path, w.numpy()
(True, array([0., 1., 2.]))
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import numpy as np

from mpistrat import context, nest
from mpistrat.collectives.handshake import code
from mpistrat.errors import ContextError, InvalidArgumentError
from mpistrat.optimizers import Optimizer
from mpistrat.variables import Variable, _to_numpy

__all__ = ["Checkpoint"]

INDEX = "checkpoint"  # in a checkpoint's directory: names the latest one
_META = "__mpistrat__"
_FORMAT = 1


def _before_rename(tmp: str, path: str) -> None:
    """Called between writing the temporary file and renaming it (a seam for tests)."""


class Checkpoint:
    """Save and restore named variables, optimizers and nests (dicts, lists) of them.

    Entries are named by their keyword and key path, e.g. ``model/w``; an
    optimizer contributes ``<name>/iterations`` and one entry per slot,
    ``<name>/slots/<variable's entry>/<slot>``, so its variables must be tracked
    by the same checkpoint.

    Args:
        **trackables: ``Variable``, optimizer, or a dict/list/tuple nest of variables.
    """

    def __init__(self, **trackables: Any):
        self._variables: dict[str, Variable] = {}
        self._optimizers: dict[str, Optimizer] = {}
        for key, value in trackables.items():
            if key.startswith("__"):
                raise InvalidArgumentError(f"Checkpoint: names starting with '__' are reserved; got {key!r}")
            for path, leaf in nest.flatten_with_paths(value):
                name = "/".join([key, *map(str, path)])
                if isinstance(leaf, Variable):
                    self._variables[name] = leaf
                elif isinstance(leaf, Optimizer):
                    self._optimizers[name] = leaf
                else:
                    raise InvalidArgumentError(
                        f"Checkpoint: {name} must be a Variable, an optimizer or a nest of them; "
                        f"got {type(leaf).__name__}"
                    )

    # -- what is saved --------------------------------------------------------------------

    def _entries(self) -> dict[str, Variable]:
        """Every entry, in name order (the same on every rank)."""
        entries = dict(self._variables)
        names = {id(v): n for n, v in self._variables.items()}
        for opt_name, opt in self._optimizers.items():
            entries[f"{opt_name}/iterations"] = opt.iterations
            for var, slots in opt._slots.values():
                if id(var) not in names:
                    raise InvalidArgumentError(
                        f"Checkpoint: optimizer {opt_name!r} has slots for variable {var.name!r}, which this "
                        "checkpoint does not track; pass that variable to Checkpoint(...) too"
                    )
                for slot_name, slot in slots.items():
                    entries[f"{opt_name}/slots/{names[id(var)]}/{slot_name}"] = slot
        return dict(sorted(entries.items()))

    def _build_slots(self, names: list[str]) -> None:
        """Create the optimizer slots a checkpoint holds for tracked variables (collective)."""
        for opt_name, opt in self._optimizers.items():
            prefix = f"{opt_name}/slots/"
            wanted = {n[len(prefix) :].rsplit("/", 1)[0] for n in names if n.startswith(prefix)}
            opt.build([self._variables[w] for w in sorted(wanted) if w in self._variables])

    def _strategy(self, method: str) -> Any:
        """The strategy whose ranks take part: the tracked variables' (all one), else the current one."""
        owners = {id(s): s for v in self._variables.values() if (s := v.distribute_strategy) is not None}
        if len(owners) > 1:
            raise InvalidArgumentError(
                f"Checkpoint.{method}: the tracked variables belong to different strategies"
            )
        mode = context.current_mode()
        strategy = next(iter(owners.values())) if owners else mode.strategy
        if mode.kind in ("replica", "merge"):
            raise ContextError(
                f"Checkpoint.{method} is collective: call it on every rank in cross-replica context "
                "(outside strategy.run and merge_fn)"
            )
        if mode.kind != "default" and mode.strategy is not strategy:
            raise ContextError(
                f"Checkpoint.{method}: the variables belong to {strategy}, not to {mode.strategy}"
            )
        return strategy

    # -- save / restore / latest ---------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write every entry to ``path`` (collective; rank 0 writes, atomically); returns ``path``.

        Also records ``path`` as the latest checkpoint of its directory.
        """
        path = os.fspath(path)
        if os.path.basename(path) == INDEX:
            raise InvalidArgumentError(
                f"Checkpoint.save: {INDEX!r} is the index file's name; pick another name"
            )
        strategy = self._strategy("save")
        collectives = strategy.extended.collectives
        entries = self._entries()
        described = [(n, str(v.dtype), v.shape) for n, v in entries.items()]
        collectives.agree(
            "checkpoint.save", fingerprint=code(repr(described)), describe=lambda: {"leaves": described}
        )
        arrays = {n: _to_numpy(v.value()) for n, v in entries.items()}  # sync-on-read values aggregate here
        meta = {"format": _FORMAT, "num_replicas": strategy.num_replicas_in_sync}
        arrays[_META] = np.array(json.dumps(meta))

        def write() -> None:
            _write_atomic(path, arrays)
            _write_atomic(os.path.join(os.path.dirname(path) or ".", INDEX), json.dumps({"latest": path}))

        collectives.on_root(write, kind="checkpoint.save (write)")
        return path

    def restore(self, path: str | os.PathLike[str] | None, *, expect_partial: bool = False) -> str | None:
        """Load ``path`` into the tracked objects (collective); ``None`` does nothing.

        Missing entries, entries whose shape or dtype differ, and (unless
        ``expect_partial``) entries of the file that nothing here tracks are an
        error naming them; nothing is assigned then. Returns ``path``.
        """
        if path is None:
            return None
        path = os.fspath(path)
        strategy = self._strategy("restore")
        collectives = strategy.extended.collectives
        collectives.agree("checkpoint.restore")

        def read() -> dict[str, np.ndarray]:
            with np.load(path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}

        body = collectives.on_root(read, kind="checkpoint.restore (read)")
        if _META not in body:
            raise InvalidArgumentError(f"Checkpoint.restore: {path} is not an mpistrat checkpoint")
        body.pop(_META)
        self._build_slots(sorted(body))
        entries = self._entries()
        _check_match(path, entries, body, expect_partial)
        with strategy.extended.writes_in_sync():  # every rank assigns rank 0's broadcast values
            for name, var in entries.items():
                var.assign(body[name])
        return path

    def latest(self, directory: str | os.PathLike[str]) -> str | None:
        """The path of the newest checkpoint saved in ``directory``, or None (collective)."""
        strategy = self._strategy("latest")
        collectives = strategy.extended.collectives
        collectives.agree("checkpoint.latest")

        def find() -> str | None:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                with open(os.path.join(os.fspath(directory), INDEX)) as f:
                    latest = json.load(f)["latest"]
                candidate = os.path.join(os.fspath(directory), os.path.basename(latest))
                return candidate if os.path.isfile(candidate) else None
            return None

        return collectives.on_root(find, kind="checkpoint.latest (read)")


def _check_match(path: str, entries: dict[str, Variable], data: dict[str, np.ndarray], partial: bool) -> None:
    missing = [n for n in entries if n not in data]
    unused = [n for n in data if n not in entries]
    mismatched = [
        f"{n} (checkpoint: {data[n].dtype}{list(data[n].shape)}, here: {v.dtype}{list(v.shape)})"
        for n, v in entries.items()
        if n in data and (data[n].shape != v.shape or data[n].dtype != v.dtype)
    ]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing)}")
    if mismatched:
        problems.append(f"different shape or dtype: {'; '.join(mismatched)}")
    if unused and not partial:
        problems.append(
            f"in the checkpoint but not tracked here: {', '.join(unused)} (pass expect_partial=True)"
        )
    if problems:
        raise InvalidArgumentError(f"Checkpoint.restore({path!r}): " + ". ".join(problems))


def _write_atomic(path: str, content: dict[str, np.ndarray] | str) -> None:
    """Write to a temporary file in the same directory, fsync it, rename it over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            if isinstance(content, str):
                f.write(content.encode())
            else:
                np.savez(f, **content)
            f.flush()
            os.fsync(f.fileno())
        _before_rename(tmp, path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
