"""The operations ``mpistrat bench`` measures, each next to its raw mpi4py equivalent.

Each operation builds a :class:`~mpistrat.tools.bench_case.Case` for one message size
(``bench_case`` says how); the collectives and the training steps are here, the optimizer
steps in ``bench_optimizer``. :data:`OPS` names them all.

>>> sorted(OPS)[:3]
['all_gather', 'all_gather_uneven', 'all_reduce']
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.comm.mpi import mpi_datatype
from mpistrat.tools.bench_case import (
    Case,
    Op,
    Setup,
    allgather_factor,
    allreduce_factor,
    check_nest,
    equal,
    filled,
    nest,
    pattern,
    split,
)
from mpistrat.tools.bench_checkpoint import checkpoint_restore, checkpoint_save, io_factor
from mpistrat.tools.bench_optimizer import apply_gradients
from mpistrat.tools.replica import replica_context

__all__ = ["DEFAULT_OPS", "GROUPS", "OPS", "OPT_IN", "Case", "Op", "Setup"]


# -- all_reduce of one array -------------------------------------------------------------


def _all_reduce(s: Setup) -> Case:
    count = max(1, s.nbytes // s.dtype.itemsize)
    x, want = filled(count, s)
    recv = np.empty_like(x)
    ctx = replica_context()
    comm = s.comm

    def raw() -> np.ndarray:
        comm.Allreduce(x, recv, op=MPI.SUM)
        return recv

    check = equal(want, s.rtol)
    return Case(
        x.nbytes, count, 1, {"mpistrat": (lambda: ctx.all_reduce("sum", x), check), "raw": (raw, check)}
    )


# -- all_reduce of a nest of K leaves of the same total size --------------------------


def _all_reduce_nest(s: Setup) -> Case:
    count = max(s.leaves, s.nbytes // s.dtype.itemsize)
    tree, wants = nest(count, s)
    recvs = {k: np.empty_like(v) for k, v in tree.items()}
    flat, flat_recv = np.concatenate(list(tree.values())), np.empty(count, s.dtype)
    ctx = replica_context()
    comm = s.comm

    def raw() -> dict[str, np.ndarray]:
        for k, v in tree.items():
            comm.Allreduce(v, recvs[k], op=MPI.SUM)
        return recvs

    def raw_one() -> np.ndarray:
        comm.Allreduce(flat, flat_recv, op=MPI.SUM)
        return flat_recv

    check = check_nest(wants, s.rtol)
    return Case(
        count * s.dtype.itemsize,
        count,
        s.leaves,
        {
            "mpistrat": (lambda: ctx.all_reduce("sum", tree), check),
            "raw": (raw, check),
            "raw2": (raw_one, equal(np.concatenate(list(wants.values())))),
        },
    )


# -- all_gather, even and uneven ------------------------------------------------------


def _gather_counts(total: int, n: int, uneven: bool) -> list[int]:
    """Elements each rank contributes; uneven: in proportion to rank + 1, at least one each."""
    if not uneven:
        return [max(1, total // n)] * n
    weights = [(r + 1) / (n * (n + 1) / 2) for r in range(n)]
    counts = [max(1, int(total * w)) for w in weights]
    counts[-1] = max(1, total - sum(counts[:-1]))
    return counts


def _all_gather(s: Setup, uneven: bool) -> Case:
    counts = _gather_counts(max(1, s.nbytes // s.dtype.itemsize), s.size, uneven)
    pieces = [pattern(c, s.dtype) * s.dtype.type(r + 1) for r, c in enumerate(counts)]
    x, want = pieces[s.rank], np.concatenate(pieces)
    ctx = replica_context()
    comm = s.comm
    datatype = mpi_datatype(s.dtype)
    check = equal(want, s.rtol)

    if uneven:

        def raw() -> np.ndarray:
            sizes = np.empty(comm.Get_size(), dtype=np.int64)
            comm.Allgather(np.array([x.size], dtype=np.int64), sizes)
            displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
            recv = np.empty(int(sizes.sum()), dtype=x.dtype)
            comm.Allgatherv(x, [recv, sizes.tolist(), displs.tolist(), datatype])
            return recv

    else:
        recv = np.empty(want.size, dtype=s.dtype)

        def raw() -> np.ndarray:
            comm.Allgather(x, recv)
            return recv

    return Case(
        want.nbytes,
        want.size,
        1,
        {"mpistrat": (lambda: ctx.all_gather(x, axis=0), check), "raw": (raw, check)},
    )


# -- merge_call -----------------------------------------------------------------------


def _sum_values(strategy: Any, value: Any) -> np.ndarray:
    return sum(value.values[1:], value.values[0].copy())


def _merge_call(s: Setup) -> Case:
    count = max(1, s.nbytes // s.dtype.itemsize)
    x, want = filled(count, s)
    ctx = replica_context()
    comm = s.comm

    def raw() -> np.ndarray:
        values = comm.gather(x, root=0)
        result = _sum_values(None, mpistrat.PerReplica(values)) if values is not None else None
        return comm.bcast(result, root=0)

    check = equal(want, s.rtol)
    return Case(
        x.nbytes,
        count,
        1,
        {"mpistrat": (lambda: ctx.merge_call(_sum_values, args=(x,)), check), "raw": (raw, check)},
    )


# -- Strategy.reduce in cross-replica context -----------------------------------------


def _reduce(s: Setup) -> Case:
    count = max(1, s.nbytes // s.dtype.itemsize)
    x, want = filled(count, s)
    recv = np.empty_like(x)
    strategy, comm = s.strategy, s.comm

    def raw() -> np.ndarray:
        comm.Allreduce(x, recv, op=MPI.SUM)
        return recv

    check = equal(want, s.rtol)
    return Case(
        x.nbytes,
        count,
        1,
        {"mpistrat": (lambda: strategy.reduce("sum", x, axis=None), check), "raw": (raw, check)},
    )


# -- a strategy.run step with a fused (MEAN) gradient all-reduce ----------------------


def _mean(total: np.ndarray, n: int) -> np.ndarray:
    return np.true_divide(total, n)


def _run_step(s: Setup) -> Case:
    count = max(s.leaves, s.nbytes // s.dtype.itemsize)
    grads, sums = nest(count, s)
    wants = {k: _mean(v, s.size) for k, v in sums.items()}
    strategy, comm, n = s.strategy, s.comm, s.size
    names = list(grads)
    bounds = np.cumsum([0, *[grads[k].size for k in names]]).tolist()

    def step(g: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return replica_context().all_reduce("mean", g)

    def raw() -> dict[str, np.ndarray]:
        buf = np.concatenate([grads[k] for k in names])
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        buf = _mean(buf, n)
        return {k: buf[a:b] for k, a, b in zip(names, bounds[:-1], bounds[1:], strict=True)}

    check = check_nest(wants, s.rtol)
    return Case(
        count * s.dtype.itemsize,
        count,
        s.leaves,
        {"mpistrat": (lambda: strategy.run(step, args=(grads,)), check), "raw": (raw, check)},
    )


# -- a data-parallel training step with compute (for strong and weak scaling) ---------

_FEATURES = 64


def _train_step(s: Setup) -> Case:
    """Least squares on a linear model: gradients of ``K`` weight leaves, then a fused MEAN.

    The weights are zero, so rank ``r``'s gradient is ``-(r+1)^2 X^T Y / b`` for fixed
    ``X`` and ``Y``, and the mean over ranks is known in closed form.
    """
    count = max(s.leaves, s.nbytes // s.dtype.itemsize)
    d = min(_FEATURES, count)
    h = max(s.leaves, count // d)
    widths = split(h, s.leaves)
    local = max(1, s.batch // s.size) if s.scaling == "strong" else max(1, s.batch)
    rng = np.random.default_rng(0)
    dtype = s.dtype if s.dtype.kind == "f" else np.dtype(np.float32)
    base_x = rng.standard_normal((local, d)).astype(dtype)
    base_y = [rng.standard_normal((local, w)).astype(dtype) for w in widths]
    x = base_x * dtype.type(s.rank + 1)
    ys = [y * dtype.type(s.rank + 1) for y in base_y]
    names = [f"layer{k:03d}" for k in range(len(widths))]
    weights = {k: np.zeros((d, w), dtype) for k, w in zip(names, widths, strict=True)}
    scale = sum((r + 1) ** 2 for r in range(s.size)) / s.size
    wants = {
        k: -(base_x.T.astype(np.float64) @ y) * scale / local for k, y in zip(names, base_y, strict=True)
    }
    strategy, comm, n = s.strategy, s.comm, s.size
    bounds = np.cumsum([0, *[d * w for w in widths]]).tolist()

    def grads() -> dict[str, np.ndarray]:
        return {k: x.T @ (x @ weights[k] - y) / dtype.type(local) for k, y in zip(names, ys, strict=True)}

    def step() -> dict[str, np.ndarray]:
        return replica_context().all_reduce("mean", grads())

    def raw() -> dict[str, np.ndarray]:
        g = grads()
        buf = np.concatenate([g[k].reshape(-1) for k in names])
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        buf /= dtype.type(n)
        return {k: buf[a:b].reshape(d, -1) for k, a, b in zip(names, bounds[:-1], bounds[1:], strict=True)}

    tol = max(1e-3 if dtype.itemsize <= 4 else 1e-9, s.rtol)

    def check(got: Any) -> bool:
        return all(
            np.allclose(got[k], w, rtol=tol, atol=tol * float(np.abs(w).max() + 1)) for k, w in wants.items()
        )

    total = d * h
    return Case(
        total * dtype.itemsize,
        total,
        len(names),
        {"mpistrat": (lambda: strategy.run(step), check), "raw": (raw, check)},
    )


# The optimizer steps: name -> (what is timed, footprint). SGD and Adam check against a closed
# form; the others against their flat step run in float64 (their reference adds ~12x the size).
_OPTIMIZERS = {
    "sgd": ("SGD(momentum=0.9)", 21),
    "adam": ("Adam()", 24),
    "adamw": ("AdamW()", 38),
    "rmsprop": ("RMSprop()", 36),
    "lamb": ("Lamb()", 38),
    "adamw_clip": ("AdamW(global_clipnorm=1)", 38),
    "rmsprop_clip": ("RMSprop(global_clipnorm=1)", 36),
    "lamb_clip": ("Lamb(global_clipnorm=1)", 38),
}

OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op(
            "all_reduce",
            "all_reduce(SUM) of one array",
            "Allreduce",
            None,
            "replica",
            allreduce_factor,
            _all_reduce,
            (6, 0),
        ),
        Op(
            "all_reduce_nest",
            "all_reduce(SUM) of a nest of K leaves, same total",
            "K x Allreduce",
            "1 x Allreduce of the total",
            "replica",
            allreduce_factor,
            _all_reduce_nest,
            (7, 0),
        ),
        Op(
            "all_gather",
            "all_gather(axis=0), even sizes",
            "Allgather",
            None,
            "replica",
            allgather_factor,
            lambda s: _all_gather(s, uneven=False),
            (5, 0),
        ),
        Op(
            "all_gather_uneven",
            "all_gather(axis=0), rank r sends ~(r+1) parts",
            "Allgather(counts) + Allgatherv",
            None,
            "replica",
            allgather_factor,
            lambda s: _all_gather(s, uneven=True),
            (4, 0),
        ),
        Op(
            "merge_call",
            "merge_call(sum of PerReplica)",
            "gather + bcast",
            None,
            "replica",
            lambda n: 1.0,
            _merge_call,
            (6, 1),
        ),
        Op(
            "reduce",
            "Strategy.reduce(SUM, axis=None)",
            "Allreduce",
            None,
            "cross_replica",
            allreduce_factor,
            _reduce,
            (4, 0),
        ),
        Op(
            "run_step",
            "strategy.run(step): all_reduce(MEAN) of K gradients",
            "concatenate + Allreduce + divide",
            None,
            "none",
            allreduce_factor,
            _run_step,
            (5, 0),
        ),
        Op(
            "train_step",
            "strategy.run: K linear-layer gradients + all_reduce(MEAN)",
            "same gradients + concatenate + Allreduce",
            None,
            "none",
            allreduce_factor,
            _train_step,
            (12, 0),
        ),
        *(
            Op(
                f"apply_gradients_{name}",
                f"{label}.apply_gradients, K variables",
                f"concatenate + Allreduce + {label} update by hand, per variable",
                "flat params/slots + Allreduce + one vectorised update",
                "none",
                allreduce_factor,
                apply_gradients(name),
                (footprint, 0),
            )
            for name, (label, footprint) in _OPTIMIZERS.items()
        ),
        Op(
            "checkpoint_save",
            "Checkpoint.write: K variables + Adam slots, every rank its share (busbw: per rank)",
            "Write_at_all of 1/R of the same bytes + Sync + rename",
            "the same + its CRC-32C gathered, the rename made durable (fsync of the folder)",
            "none",
            io_factor,
            checkpoint_save,
            (8, 0),
        ),
        Op(
            "checkpoint_restore",
            "Checkpoint.read of the same (busbw: per rank)",
            "Read_at_all of 1/R + Allgather",
            "the same into a new buffer + its CRC-32C shared, before the Allgather",
            "none",
            io_factor,
            checkpoint_restore,
            (16, 0),
        ),
    )
}

# Names that stand for several ops on the command line.
GROUPS = {"checkpoint": ("checkpoint_save", "checkpoint_restore")}

# What a plain ``mpistrat bench`` runs. Opt-in: train_step (compute-bound, for scaling studies),
# the optimizer steps (64 variables cost ~6-14 ms a step, so over the default sweep they took 5.3
# minutes at 2 ranks, where every other op together took 3) and the checkpoint ops (they write files).
OPT_IN = (
    "train_step",
    *(f"apply_gradients_{name}" for name in _OPTIMIZERS),
    "checkpoint_save",
    "checkpoint_restore",
)
DEFAULT_OPS = [name for name in OPS if name not in OPT_IN]
