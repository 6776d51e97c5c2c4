"""How long a job takes to go on after a rank is killed, and how many steps it loses.

    python -m benchmarks.recovery [--ranks 4 8] [--repeats 5] [--parameters 1048576]

Runs ``mpiexec --with-ft ulfm --mca pml ob1 --mca btl self,tcp -n R`` jobs of this script (the
``--worker`` mode): Adam over ``--parameters`` float32 parameters (sharded and not), a step of
each rank's random gradients; at step 5 the last rank kills itself with SIGKILL inside the step,
before ``apply_gradients`` (the step is then done again) or in the update, once the gradients were
summed (the survivors completed the step: it is kept). Every rank prints wall-clock times (one
machine: one clock): the kill; each survivor's ``PeerFailedError``; ``strategy.recover()``'s end;
the end of the first step completed after it. Printed per case, medians over the repeats:
detection (kill to the last survivor's error), recovery (its ``seconds``, the slowest survivor),
kill to the next completed step, and the steps lost (done again).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

KILL_AT = 5


def worker(args: argparse.Namespace) -> None:
    import mpistrat  # after the launch: MPI starts here

    strategy = mpistrat.MPIStrategy()
    rank = strategy.extended.rank
    world = mpistrat.MPI.COMM_WORLD.Get_rank()
    victim = world == mpistrat.MPI.COMM_WORLD.Get_size() - 1
    with strategy.scope():
        w = mpistrat.Variable(np.zeros(args.parameters, np.float32))
        opt = mpistrat.optimizers.Adam(1e-3, shard_state=args.shard)
    grad = np.random.default_rng(rank).standard_normal(args.parameters).astype(np.float32)

    class Dying(type(opt)):  # type: ignore[misc]
        def _update_flat(self, w, g, slots, lr, step):  # type: ignore[no-untyped-def]
            if victim and step == KILL_AT and args.where == "update":
                print(f"KILL {time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            super()._update_flat(w, g, slots, lr, step)

    opt.__class__ = Dying

    def step() -> None:
        if victim and int(opt.iterations.numpy()) == KILL_AT and args.where == "inside":
            print(f"KILL {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.apply_gradients([(grad, w)])

    recovered = False
    while int(opt.iterations.numpy()) < KILL_AT + 3:
        try:
            strategy.run(step)
        except mpistrat.PeerFailedError:
            print(f"ERROR {world} {time.time():.6f}", flush=True)
            done = strategy.recover()
            steps = int(opt.iterations.numpy())
            print(f"RECOVERED {world} {time.time():.6f} {done.seconds:.6f} {steps}", flush=True)
            recovered = True
            continue
        if recovered:
            print(f"STEP {world} {time.time():.6f} {int(opt.iterations.numpy())}", flush=True)
            recovered = False


def run_case(ranks: int, shard: bool, where: str, parameters: int) -> dict[str, float] | None:
    options = ["--oversubscribe", "--with-ft", "ulfm", "--mca", "pml", "ob1", "--mca", "btl", "self,tcp"]
    if os.geteuid() == 0:
        options.append("--allow-run-as-root")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [mpiexec, *options, "-n", str(ranks), sys.executable, "-m", "benchmarks.recovery", "--worker"]
    cmd += ["--where", where, "--parameters", str(parameters)] + (["--shard"] if shard else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout
    kill = [float(t) for t in re.findall(r"^KILL (\S+)", out, re.M)]
    errors = [float(t) for _, t in re.findall(r"^ERROR (\d+) (\S+)", out, re.M)]
    recovered = re.findall(r"^RECOVERED (\d+) (\S+) (\S+) (\d+)", out, re.M)
    steps = [float(t) for _, t, _ in re.findall(r"^STEP (\d+) (\S+) (\d+)", out, re.M)]
    if not kill or not recovered or not steps:
        print(f"  (a run failed:\n{out[-2000:]})")
        return None
    applied = int(recovered[0][3])  # the steps the survivors went on from
    return {
        "detection": (max(errors) - kill[0]) if errors else float("nan"),
        "recovery": max(float(s) for _, _, s, _ in recovered),
        "next step": max(steps) - kill[0],
        "lost": KILL_AT + 1 - applied,  # the step in progress: kept (0) or done again (1)
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--shard", action="store_true")
    parser.add_argument("--where", default="inside")
    parser.add_argument("--parameters", type=int, default=1 << 20)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    header = f"{'ranks':>5s} {'state':9s} {'killed':7s} {'detect s':>9s} {'recover s':>9s}"
    print(f"{header} {'to next step s':>14s} lost")
    for ranks in args.ranks:
        for shard in (False, True):
            for where in ("inside", "update"):
                cases = (run_case(ranks, shard, where, args.parameters) for _ in range(args.repeats))
                runs = [r for r in cases if r]
                if not runs:
                    continue
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                print(
                    f"{ranks:5d} {'sharded' if shard else 'mirrored':9s} {where:7s} {med['detection']:9.3f} "
                    f"{med['recovery']:9.3f} {med['next step']:14.3f} {med['lost']:.0f}"
                )


if __name__ == "__main__":
    main()
