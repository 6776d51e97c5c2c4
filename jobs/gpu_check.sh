#!/usr/bin/env bash
# Every GPU check in one run, for a machine with a CUDA GPU (`make gpu-check`):
#   the machine (GPU, driver, CUDA, CuPy, NCCL, MPI), the collective suite over CuPy arrays at 1 and
#   2 ranks (`make test-gpu`: collectives, merge_call, Adam sharded and not, checkpoints), `mpistrat
#   info` at 2 ranks, the digits example on the GPU beside the CPU, and device all-reduce bandwidth
#   beside bare NCCL and host MPI (python -m mpistrat.tools.bench_gpu) at 1 and 2 ranks, with where
#   one small device all_reduce spends its time (python -m benchmarks.device_call).
# Each step has a time limit and a log in $RESULTS; a failed step does not stop the others, and the
# exit status says whether any failed. Without CuPy or a CUDA device it says why and exits 0.
#
#   make gpu-check                                    # .venv with the cuda extra
#   PY=python3 MPIEXEC=mpiexec RESULTS=out bash jobs/gpu_check.sh
#   BENCH_MAX=256MiB make gpu-check                   # a shorter bandwidth sweep
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-.venv/bin/mpiexec}
RESULTS=${RESULTS:-results/gpu-check}
BENCH_MIN=${BENCH_MIN:-1KiB}
BENCH_MAX=${BENCH_MAX:-1GiB}
mkdir -p "$RESULTS"

if ! why=$("$PY" -c '
import cupy
n = cupy.cuda.runtime.getDeviceCount()
assert n > 0, "CUDA reports no device"
print(n)' 2>&1); then
    echo "gpu-check skipped: no usable CuPy and CUDA device here ($(echo "$why" | tail -n 1))"
    exit 0
fi

failed=()
step() {  # step NAME SECONDS COMMAND...: run it, its output in $RESULTS/NAME.log
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name: $*"
    if timeout -k 10 "$limit" "$@" >"$RESULTS/$name.log" 2>&1; then
        echo "   passed in $((SECONDS - start)) s"
    else
        echo "   FAILED (status $?) in $((SECONDS - start)) s; the end of $RESULTS/$name.log:"
        tail -n 25 "$RESULTS/$name.log" | sed 's/^/   | /'
        failed+=("$name")
    fi
}

machine() {
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv
    "$PY" -c '
import platform, cupy, mpi4py, numpy
from mpi4py import MPI
rt = cupy.cuda.runtime
print("python", platform.python_version(), "numpy", numpy.__version__, "cupy", cupy.__version__)
print("CUDA runtime", rt.runtimeGetVersion(), "driver", rt.driverGetVersion())
try:
    from cupy.cuda import nccl
    print("NCCL", nccl.get_version())
except Exception as exc:
    print("NCCL not usable:", exc)
print("mpi4py", mpi4py.__version__, "|", MPI.Get_library_version().splitlines()[0])'
}

export PY
export -f machine
step machine 60 bash -c machine
export MPISTRAT_REQUIRE_GPU=1
step test-gpu-1 600 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/comm/test_gpu.py
step test-gpu-2 600 "$MPIEXEC" -n 2 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider --with-mpi \
    tests/comm/test_gpu.py
step info-2 120 "$MPIEXEC" -n 2 "$PY" -m mpistrat info
step info-2-json 120 bash -c '"$0" -n 2 "$1" -m mpistrat info --json >"$2"' "$MPIEXEC" "$PY" "$RESULTS/info-2.json"
digits=(-m mpistrat.examples.digits --checkpoint-dir "" --no-progress)
step digits-gpu-1 300 "$PY" "${digits[@]}" --device gpu
step digits-gpu-2 300 "$MPIEXEC" -n 2 "$PY" "${digits[@]}" --device gpu
step digits-cpu-2 300 "$MPIEXEC" -n 2 "$PY" "${digits[@]}" --device cpu
step device-call 120 "$PY" -m benchmarks.device_call --parts
for n in 1 2; do
    step "bench-gpu-$n" 600 "$MPIEXEC" -n "$n" "$PY" -m mpistrat.tools.bench_gpu --min "$BENCH_MIN" \
        --max "$BENCH_MAX" --json "$RESULTS/bench-gpu-$n.json"
done

echo "== digits accuracy (GPU at 1 and 2 ranks, CPU at 2):"
grep "test accuracy" "$RESULTS"/digits-*.log | sed 's/^/   /'
if ((${#failed[@]})); then
    echo "gpu-check: ${#failed[@]} step(s) failed: ${failed[*]} (logs in $RESULTS)"
    exit 1
fi
echo "gpu-check: every step passed (logs and JSON in $RESULTS)"
