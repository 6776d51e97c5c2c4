#!/bin/bash
# Submit a strong- or weak-scaling series, then a job that collects and plots it.
#
#   jobs/scaling.sh weak 1 2 4 8 16          # one bench job per task count
#   UNIT=nodes TASKS_PER_NODE=4 jobs/scaling.sh strong 1 2 4 8
#   WORKLOAD=train jobs/scaling.sh strong 2 4 8
#
# Arguments: MODE (strong | weak, default weak) then the counts (default: 1 2 4). Every
# job of the series writes results/<jobid>/; the collect job writes results/<its jobid>/
# with scaling.png (time, speed-up and efficiency versus ranks), bandwidth.png,
# ratio.png and all.csv (every run's rows). Environment:
#   UNIT            tasks | nodes: what the counts count                  (default: tasks)
#   TASKS_PER_NODE  tasks per node when UNIT=nodes                        (default: 1)
#   WORKLOAD        bench | train                                         (default: bench)
#   BENCH_ARGS      `mpistrat bench` arguments; the default times a data-parallel
#                   training step (train_step: gradients of a 4 MiB linear model on
#                   BATCH samples, fused all-reduce) and all_reduce at 4 MiB; --scaling
#                   MODE is added: strong keeps BATCH as the global batch, weak gives
#                   every rank BATCH samples
#   BATCH           batch size of the default BENCH_ARGS                  (default: 1024)
#   TRAIN_ARGS      arguments of the training example (WORKLOAD=train)
#   SBATCH_ARGS     options for every sbatch, e.g. "--partition=p --time=0:20:00 --account=a"
#   PYTHON, MPI_LAUNCH, RESULTS_DIR   as in bench.sbatch, passed on to every job
set -euo pipefail

JOBS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODE=${1:-weak}
[ $# -gt 0 ] && shift
COUNTS=("$@")
[ ${#COUNTS[@]} -gt 0 ] || COUNTS=(1 2 4)
case "$MODE" in strong | weak) ;; *)
    echo "scaling.sh: MODE must be strong or weak; got '$MODE'" >&2
    exit 2
    ;;
esac
UNIT=${UNIT:-tasks}
WORKLOAD=${WORKLOAD:-bench}
BATCH=${BATCH:-1024}
read -r -a sbatch_args <<< "${SBATCH_ARGS:-}"
export RESULTS_DIR=${RESULTS_DIR:-$PWD/results}
export PYTHON=${PYTHON:-python3}
export PLOT=0  # the collect job plots the whole series
mkdir -p "$RESULTS_DIR"
BENCH_ARGS=${BENCH_ARGS:-"--ops train_step,all_reduce --min 4MiB --max 4MiB --iters 20 --min-iters 10 --batch $BATCH"}
export BENCH_ARGS="$BENCH_ARGS --scaling $MODE"

ids=()
for n in "${COUNTS[@]}"; do
    case "$UNIT" in
        tasks) size=(--ntasks="$n") ;;
        nodes) size=(--nodes="$n" --ntasks-per-node="${TASKS_PER_NODE:-1}") ;;
        *)
            echo "scaling.sh: UNIT must be tasks or nodes; got '$UNIT'" >&2
            exit 2
            ;;
    esac
    script="$JOBS_DIR/bench.sbatch"
    [ "$WORKLOAD" = train ] && script="$JOBS_DIR/train.sbatch"
    id=$(sbatch --parsable "${size[@]}" --job-name="mpistrat-$MODE-$n" \
        --output="$RESULTS_DIR/slurm-%j.out" "${sbatch_args[@]}" "$script")
    id=${id%%;*}
    echo "submitted $WORKLOAD on $n $UNIT: job $id"
    ids+=("$id")
done

dependency=afterany:$(IFS=:; echo "${ids[*]}")
collect=$(SERIES="${ids[*]}" WORKLOAD="$WORKLOAD" sbatch --parsable --ntasks=1 --dependency="$dependency" \
    --job-name="mpistrat-$MODE-collect" --output="$RESULTS_DIR/slurm-%j.out" "${sbatch_args[@]}" \
    "$JOBS_DIR/collect.sbatch")
collect=${collect%%;*}
echo "submitted collect: job $collect (after ${ids[*]}); plots in $RESULTS_DIR/$collect/"
