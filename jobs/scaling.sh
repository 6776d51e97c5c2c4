#!/bin/bash
# Submit a strong- or weak-scaling series, then a job that collects and plots it.
#
#   jobs/scaling.sh weak 1 2 4 8 16          # one bench job per task count
#   UNIT=nodes TASKS_PER_NODE=4 jobs/scaling.sh strong 1 2 4 8
#   WORKLOAD=train jobs/scaling.sh strong 2 4 8
#   WORKLOAD=checkpoint jobs/scaling.sh strong 1 2 4 8   # save and restore time versus ranks
#
# Arguments: MODE (strong | weak, default weak) then the counts (default: 1 2 4). Every
# job of the series writes results/<jobid>/; the collect job writes results/<its jobid>/
# with scaling.png (time, speed-up and efficiency versus ranks), bandwidth.png,
# ratio.png and all.csv (every run's rows). Environment:
#   UNIT            tasks | nodes: what the counts count                  (default: tasks)
#   TASKS_PER_NODE  tasks per node when UNIT=nodes                        (default: 1)
#   WORKLOAD        bench | train | checkpoint                            (default: bench)
#   BENCH_ARGS      `mpistrat bench` arguments; the default times a data-parallel
#                   training step (train_step: gradients of a 4 MiB linear model on
#                   BATCH samples, fused all-reduce) and all_reduce at 4 MiB; --scaling
#                   MODE is added: strong keeps BATCH as the global batch, weak gives
#                   every rank BATCH samples. WORKLOAD=checkpoint's default saves and
#                   restores 64 MiB of parameters with Adam (a 192 MiB file) beside raw
#                   MPI-IO, in CHECKPOINT_DIR
#   CHECKPOINT_DIR  where WORKLOAD=checkpoint writes its files: the parallel file system
#                   a job checkpoints to                 (default: RESULTS_DIR/checkpoint-files)
#   BATCH           batch size of the default BENCH_ARGS                  (default: 1024)
#   TRAIN_ARGS      arguments of the training example (WORKLOAD=train)
#   SBATCH_ARGS     options for every sbatch, e.g. "--partition=p --time=0:20:00 --account=a"
#   PYTHON, MPI_LAUNCH, RESULTS_DIR, JOB_SETUP, PLOT, PREFLIGHT   as in bench.sbatch, passed on to every job
#   STAGE, STAGE_PACK, STAGE_DIR, STAGE_EXCLUDE   as in bench.sbatch: STAGE=1 starts every job's ranks
#                   from node-local memory; the series shares one pack (made by its first job)
# The collect job's report gives each rank count's start (process start to the first collective,
# its slowest rank) beside its step time.
#
# The settings reach the jobs in a file each one sources (results/series-*.env, handed over as
# JOB_SETUP; it sources your own JOB_SETUP first), so a site that submits with --export=NONE
# (SBATCH_EXPORT=NONE, or --export=NONE in SBATCH_ARGS) runs the series as any other.
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
case "$WORKLOAD" in bench | train | checkpoint) ;; *)
    echo "scaling.sh: WORKLOAD must be bench, train or checkpoint; got '$WORKLOAD'" >&2
    exit 2
    ;;
esac
BATCH=${BATCH:-1024}
read -r -a given_args <<< "${SBATCH_ARGS:-}"
# How sbatch hands the environment over: the site's or yours; the settings file is added to it.
export_mode=${SBATCH_EXPORT:-ALL}
sbatch_args=()
for arg in ${given_args[@]+"${given_args[@]}"}; do  # an empty array is unbound under set -u before bash 4.4
    case "$arg" in --export=*) export_mode=${arg#--export=} ;; *) sbatch_args+=("$arg") ;; esac
done
RESULTS_DIR=${RESULTS_DIR:-$PWD/results}
PYTHON=${PYTHON:-python3}
mkdir -p "$RESULTS_DIR"
RESULTS_DIR=$(cd "$RESULTS_DIR" && pwd)
case "$WORKLOAD" in
    checkpoint) default="--ops checkpoint --min 64MiB --max 64MiB --leaves 16 --iters 5 --min-iters 5 \
--checkpoint-dir ${CHECKPOINT_DIR:-$RESULTS_DIR/checkpoint-files}" ;;
    *) default="--ops train_step,all_reduce --min 4MiB --max 4MiB --iters 20 --min-iters 10 --batch $BATCH" ;;
esac
BENCH_ARGS=${BENCH_ARGS:-$default}
BENCH_ARGS="$BENCH_ARGS --scaling $MODE"
stamp="$(date +%Y%m%d-%H%M%S)-$$"
if [ -n "${JOB_SETUP:-}" ]; then  # the jobs source it from their own directory: make it absolute
    [ -f "$JOB_SETUP" ] || { echo "scaling.sh: JOB_SETUP=$JOB_SETUP is not a file" >&2; exit 2; }
    JOB_SETUP="$(cd "$(dirname "$JOB_SETUP")" && pwd)/$(basename "$JOB_SETUP")"
fi

# settings FILE NAME=VALUE...: the file a job sources first: your JOB_SETUP, then the series' settings.
settings() {
    local file=$1 name pair
    shift
    {
        echo "# jobs/scaling.sh $MODE ${COUNTS[*]}: the settings of every job of series $stamp"
        [ -z "${JOB_SETUP:-}" ] || printf 'source %q\n' "$JOB_SETUP"
        for name in PYTHON MPI_LAUNCH RESULTS_DIR BENCH_ARGS LABEL TRAIN_MODULE TRAIN_ARGS TIMELINE PREFLIGHT \
            REPORT_ARGS OMP_NUM_THREADS STAGE STAGE_PACK STAGE_DIR STAGE_EXCLUDE \
            $(compgen -e | grep '^MPISTRAT_' || true); do
            [ -z "${!name+set}" ] || printf 'export %s=%q\n' "$name" "${!name}"
        done
        for pair in "$@"; do printf 'export %s=%q\n' "${pair%%=*}" "${pair#*=}"; done
    } > "$file"
}
members="$RESULTS_DIR/series-$stamp.env"
settings "$members" PLOT=0 # the collect job plots the whole series

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
    id=$(sbatch --parsable "${size[@]}" --job-name="mpistrat-$MODE-$n" --output="$RESULTS_DIR/slurm-%j.out" \
        ${sbatch_args[@]+"${sbatch_args[@]}"} --export="$export_mode,JOB_SETUP=$members" "$script")
    id=${id%%;*}
    echo "submitted $WORKLOAD on $n $UNIT: job $id"
    ids+=("$id")
done

dependency=afterany:$(IFS=:; echo "${ids[*]}")
collector="$RESULTS_DIR/series-$stamp-collect.env"
settings "$collector" SERIES="${ids[*]}" WORKLOAD="$WORKLOAD" PLOT="${PLOT:-auto}"
collect=$(sbatch --parsable --ntasks=1 --dependency="$dependency" --job-name="mpistrat-$MODE-collect" \
    --output="$RESULTS_DIR/slurm-%j.out" ${sbatch_args[@]+"${sbatch_args[@]}"} \
    --export="$export_mode,JOB_SETUP=$collector" "$JOBS_DIR/collect.sbatch")
collect=${collect%%;*}
echo "submitted collect: job $collect (after ${ids[*]}); plots in $RESULTS_DIR/$collect/"
