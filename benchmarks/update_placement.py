"""Milliseconds of an optimizer's update over 1M float32 parameters, by where its buffers lie.

The update's passes alone (the gradient copied into the staging buffer, then ``_update_flat``),
on the same values in buffers placed five ways: the optimizer's own (``training/placement.py``),
``np.zeros`` (where ``malloc`` puts them), and 2 MiB-aligned with huge pages advised or refused
(``madvise``), each stream at the same offset modulo 4 KiB or at offsets 320 bytes apart (4K
aliasing between the streams). CPU time of this thread, the placements interleaved, median.
``docs/performance.md`` and ``placement.py`` quote it:

    python -m benchmarks.update_placement --optimizer adam rmsprop
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

import mpistrat
from mpistrat.optimizers import Adam, RMSprop

COUNT = 1 << 20
HUGE, NOHUGE = 14, 15  # MADV_HUGEPAGE, MADV_NOHUGEPAGE
_kept: list[np.ndarray] = []


def placed(values: dict[str, np.ndarray], advice: int | None, spread: bool) -> dict[str, np.ndarray]:
    """Copies of ``values``, each 2 MiB-aligned (plus 320 bytes per stream when ``spread``)."""
    out = {}
    for i, (name, value) in enumerate(values.items()):
        if advice is None:
            out[name] = np.zeros_like(value)
        else:
            raw = np.empty(value.nbytes + (4 << 20), np.uint8)
            _kept.append(raw)
            base = -raw.ctypes.data % (2 << 20)
            libc = ctypes.CDLL(None)
            libc.madvise(
                ctypes.c_void_p(raw.ctypes.data + base), ctypes.c_size_t(value.nbytes + (2 << 20)), advice
            )
            at = base + (320 * i if spread else 0)
            out[name] = raw[at : at + value.nbytes].view(value.dtype)
        out[name][...] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--optimizer", nargs="+", default=["adam"], choices=["adam", "rmsprop"])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    strategy = mpistrat.MPIStrategy()
    for name in args.optimizer:
        with strategy.scope():
            ws = [mpistrat.Variable(np.ones(COUNT // 16, np.float32)) for _ in range(16)]
            opt = Adam(1e-3) if name == "adam" else RMSprop(1e-3)
        opt.build(ws)
        group = opt._flat_state().groups[0]
        own = {"w": group.params.array, "g": group.staging, **{n: s.array for n, s in group.slots.items()}}
        sets = {
            "optimizer's": own,
            "np.zeros": placed(own, None, False),
            "2M huge": placed(own, HUGE, False),
            "2M huge, spread": placed(own, HUGE, True),
            "2M 4K pages": placed(own, NOHUGE, False),
            "2M 4K pages, spread": placed(own, NOHUGE, True),
        }
        gradient = np.full(COUNT, 0.01, np.float32)
        times: dict[str, list[float]] = {k: [] for k in sets}
        for step in range(args.iters):
            for key, s in sets.items():
                start = time.thread_time()
                np.copyto(s["g"], gradient)
                opt._update_flat(s["w"], s["g"], [a for n, a in s.items() if n not in ("w", "g")], 1e-3, step)
                times[key].append(time.thread_time() - start)
        print(name, "  ".join(f"{k}: {np.median(t) * 1e3:.2f}" for k, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
