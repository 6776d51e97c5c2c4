"""A training step whose backward pass yields gradients: list against generator, beside raw mpi4py.

    mpiexec -n 2 python -m benchmarks.overlap [--layers 16] [--size 1M] [--compute-ms 2]
        [--pack 1M | --pieces N] [--pump-ms MS] [--progress-ms MS] [--repeat 20]

Each of ``--layers`` layers has one float32 weight of ``--size`` bytes; its gradient takes
``--compute-ms`` of NumPy work to compute (the simulated backward pass, last layer first). A step:

* ``list``: compute every gradient, then ``SGD.apply_gradients(list)``: the sums start after the
  last gradient.
* ``generator``: ``SGD.apply_gradients(generator)``: each pack's sum starts once its gradients
  exist, and is tested while the next one is computed.
* ``gen. no thread``: the same without mpistrat's progress thread (``progress.PERIOD = 0``).
* ``raw``: the hand-written loop: compute every gradient, concatenate, one ``Allreduce``, update.
* ``raw overlapped``: the hand-written overlapped loop: an ``Iallreduce`` per pack as soon as its
  layers' gradients exist, ``Testall`` after each layer, ``Waitall``, update.
* ``communication``: the sums alone, one raw ``Allreduce`` of every gradient, nothing computed.

Without ``--pack`` the strategy has mpistrat's default (no ``bytes_per_pack``: the list step sums
one pack, the generator step ``overlap.PIECES`` pieces of it, ``--pieces`` to try another number);
``--pack`` sets ``CommunicationOptions(bytes_per_pack=...)``. The raw overlapped loop cuts the same
packs or pieces (in whole layers). The generator step runs mpistrat's progress thread while its sums
are in flight (``progress.PERIOD``; ``--pump-ms`` sets its period, 0 turns it off). ``--progress-ms``
runs a thread beside the generator and raw overlapped steps that enters MPI's progress engine every
MS (an ``Iprobe`` on a communicator of its own, the Python lock let go between), as a user would to
move the sums while NumPy computes. Times are medians over ``--repeat`` steps, interleaved, on rank
0's clock; "compute" is the backward pass alone. The last line is the generator step over
``max(compute, communication)``, the target's measure.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
from mpi4py import MPI

import mpistrat
from mpistrat.collectives import progress as pump
from mpistrat.optimizers import SGD
from mpistrat.options import CommunicationOptions
from mpistrat.tools.sizes import parse_size
from mpistrat.training import overlap

LR = 0.01


class Backward:
    """The simulated backward pass: layer ``i``'s gradient after ``ms`` of NumPy work."""

    def __init__(self, layers: int, n: int, ms: float, rank: int):
        rng = np.random.default_rng(rank)
        self.grads = [rng.standard_normal(n).astype(np.float32) for _ in range(layers)]
        self.work = np.ones((64, 64), np.float32)
        self.seconds = ms / 1e3

    def gradient(self, i: int) -> np.ndarray:
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            self.work = self.work @ self.work * np.float32(1 / 64)
        return self.grads[i].copy()

    def last_first(self) -> Iterator[tuple[int, np.ndarray]]:
        for i in reversed(range(len(self.grads))):
            yield i, self.gradient(i)


class Progress:
    """While in use, a thread entering MPI's progress engine every ``ms`` (none when ``ms`` is 0)."""

    def __init__(self, comm: MPI.Intracomm, ms: float):
        self.comm, self.seconds = comm.Dup(), ms / 1e3
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> None:
        if self.seconds:
            self.stop.clear()
            self.thread = threading.Thread(target=self.run, daemon=True)
            self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(self.seconds):
            self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)

    def __exit__(self, *_: object) -> None:
        if self.thread is not None:
            self.stop.set()
            self.thread.join()
            self.thread = None


def packs_of(layers: int, n: int, pack_elements: int) -> list[list[int]]:
    """Layers per pack, last first, as the flat packs group them (whole layers here)."""
    per = max(1, pack_elements // n) if pack_elements else layers
    order = list(reversed(range(layers)))
    return [order[k : k + per] for k in range(0, layers, per)]


def raw_step(comm: MPI.Intracomm, w: np.ndarray, backward: Backward, n: int) -> None:
    grads = dict(backward.last_first())
    flat = np.concatenate([grads[i] for i in range(len(grads))])
    comm.Allreduce(MPI.IN_PLACE, flat)
    flat *= LR
    w -= flat


def raw_overlapped_step(
    comm: MPI.Intracomm, w: np.ndarray, flat: np.ndarray, backward: Backward, n: int, packs: list[list[int]]
) -> None:
    requests = []
    left = {k: set(p) for k, p in enumerate(packs)}
    for i, grad in backward.last_first():
        flat[i * n : (i + 1) * n] = grad
        k = next(k for k, p in enumerate(packs) if i in p)
        left[k].discard(i)
        if not left[k]:
            lo, hi = min(packs[k]) * n, (max(packs[k]) + 1) * n
            requests.append((lo, hi, comm.Iallreduce(MPI.IN_PLACE, flat[lo:hi])))
        MPI.Request.Testall([r for _, _, r in requests])
    for lo, hi, request in requests:
        request.Wait()
        flat[lo:hi] *= LR
        w[lo:hi] -= flat[lo:hi]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--size", type=parse_size, default=1 << 20)
    parser.add_argument("--compute-ms", type=float, default=2.0)
    parser.add_argument("--pack", type=parse_size, default=None, help="bytes_per_pack (default: none)")
    parser.add_argument("--pieces", type=int, default=overlap.PIECES, help="the generator's pieces, unpacked")
    parser.add_argument("--pump-ms", type=float, default=pump.PERIOD * 1e3, help="its thread (0: none)")
    parser.add_argument("--progress-ms", type=float, default=0.0, help="a user's progress thread (0: none)")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    n, layers = args.size // 4, args.layers
    overlap.PIECES = args.pieces
    pump.PERIOD = args.pump_ms / 1e3
    options = None if args.pack is None else CommunicationOptions(bytes_per_pack=args.pack)
    strategy = mpistrat.MPIStrategy(comm, communication_options=options)
    with strategy.scope():
        variables = [mpistrat.Variable(np.zeros(n, np.float32), name=f"layer{i}") for i in range(layers)]
        opt = SGD(LR)
    backward = Backward(layers, n, args.compute_ms, rank)
    raw_w, raw_flat = np.zeros(n * layers, np.float32), np.empty(n * layers, np.float32)
    piece = args.pack if args.pack is not None else max(overlap.PIECE_BYTES, n * layers * 4 // args.pieces)
    packs = packs_of(layers, n, piece // 4)
    summed = np.ones(n * layers, np.float32)
    progress = Progress(comm, args.progress_ms)

    def listed() -> None:
        grads = dict(backward.last_first())
        pairs = [(grads[i], variables[i]) for i in reversed(range(layers))]
        strategy.run(lambda: opt.apply_gradients(pairs))

    def generated() -> None:
        with progress:
            strategy.run(lambda: opt.apply_gradients((g, variables[i]) for i, g in backward.last_first()))

    def alone(step: Callable[[], None]) -> None:
        period, pump.PERIOD = pump.PERIOD, 0.0
        try:
            step()
        finally:
            pump.PERIOD = period

    def raw_overlapped() -> None:
        with progress:
            raw_overlapped_step(comm, raw_w, raw_flat, backward, n, packs)

    def compute() -> None:
        dict(backward.last_first())
        comm.Barrier()

    steps: dict[str, Callable[[], None]] = {
        "compute": compute,
        "list": listed,
        "generator": generated,
        "gen. no thread": lambda: alone(generated),
        "raw": lambda: raw_step(comm, raw_w, backward, n),
        "raw overlapped": raw_overlapped,
        "communication": lambda: comm.Allreduce(MPI.IN_PLACE, summed),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for repeat in range(args.repeat + 2):  # the first two build the state and warm up: not timed
        for name, step in steps.items():
            comm.Barrier()
            start = time.perf_counter()
            step()
            comm.Barrier()
            if repeat >= 2:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        cut = (
            f"packs of {args.pack} B" if args.pack is not None else f"no bytes_per_pack, {args.pieces} pieces"
        )
        print(
            f"ranks {comm.Get_size()}, {layers} layers x {args.size} B float32, {args.compute_ms} ms compute "
            f"per layer, {cut} ({len(packs)} raw), progress threads: mpistrat's every {args.pump_ms} ms, "
            f"a user's every {args.progress_ms} ms, "
            f"{MPI.Get_library_version().splitlines()[0]}"
        )
        raw = statistics.median(times["raw"])
        print(f"{'step':>15} {'ms':>8} {'x raw':>6}")
        for name, values in times.items():
            ms = statistics.median(values)
            print(f"{name:>15} {ms * 1e3:8.2f} {ms / raw:6.2f}")
        bound = max(statistics.median(times["compute"]), statistics.median(times["communication"]))
        print(f"generator / max(compute, communication): {statistics.median(times['generator']) / bound:.2f}")
        print(f"without the thread: {statistics.median(times['gen. no thread']) / bound:.2f}")
    strategy.experimental_finalize()


if __name__ == "__main__":
    main()
