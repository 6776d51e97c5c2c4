#!/bin/bash
# The jobs/ scripts on a real single-node Slurm: install Debian's Slurm and MUNGE, start
# munged, slurmctld and slurmd with a private configuration, submit jobs/bench.sbatch
# (through srun, and through mpiexec inside the allocation), a jobs/scaling.sh series and
# jobs/train.sbatch, wait, check the results and plots, and stop the daemons it started.
#
#   sudo make test-slurm                     # or: sudo PYTHON=.venv/bin/python tests/slurm/run.sh
#
# Skips (exit 0, with the reason) only when not root or when the packages cannot be
# installed. Environment: PYTHON (interpreter with mpistrat; default .venv/bin/python,
# else python3), KEEP=1 keeps the work directory, SLURM_TEST_TIMEOUT (seconds to wait
# for the jobs, default 300).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=$(command -v python3); fi
fi
TIMEOUT=${SLURM_TEST_TIMEOUT:-300}
PACKAGES=(slurmctld slurmd slurm-client munge)

say() { echo "test-slurm: $*"; }
skip() {
    say "SKIPPED: $*"
    exit 0
}

[ "$(id -u)" -eq 0 ] || skip "needs root to install and run Slurm (run: sudo make test-slurm)"
command -v apt-get > /dev/null || skip "apt-get not found: installs Debian's Slurm packages"

missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2> /dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # The package scripts must not start system services: this test starts its own daemons.
    policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy"
    fi
    apt_install() {
        apt-get install -y -q -o DPkg::Lock::Timeout=300 --no-install-recommends "${missing[@]}"
    }
    log=/tmp/mpistrat-slurm-apt.log
    installed=1
    if ! apt_install > "$log" 2>&1; then
        apt-get update -q -o DPkg::Lock::Timeout=300 >> "$log" 2>&1 || true
        apt_install >> "$log" 2>&1 || installed=0
    fi
    [ -z "$policy" ] || rm -f "$policy"
    [ $installed = 1 ] || skip "could not install ${missing[*]} (log: $log)"
fi

WORK=$(mktemp -d /tmp/mpistrat-slurm.XXXXXX)
chmod 755 "$WORK"
mkdir -p "$WORK/state" "$WORK/spool" "$WORK/results"
PIDS=()
cleanup() {
    status=$?
    for pid in "${PIDS[@]}"; do kill "$pid" 2> /dev/null || true; done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2> /dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2> /dev/null || true
    done
    if [ $status -ne 0 ]; then
        for log in slurmctld.log slurmd.log munged.log; do
            [ -f "$WORK/$log" ] && { echo "--- $log (tail)"; tail -n 30 "$WORK/$log"; }
        done
        for out in "$WORK"/results/slurm-*.out "$WORK"/*.out; do
            [ -f "$out" ] && { echo "--- $out"; tail -n 40 "$out"; }
        done
        say "FAILED (work directory: $WORK)"
    elif [ "${KEEP:-0}" = 1 ]; then
        say "work directory kept: $WORK"
    else
        rm -rf "$WORK"
    fi
    exit $status
}
trap cleanup EXIT
trap 'exit 130' INT TERM

HOST=$(hostname -s)
# What this machine has, as slurmd sees it; at least 4 CPUs so 2-4 task jobs fit anywhere
# (config_overrides makes slurmd trust the configuration over the hardware).
read -r -a hardware <<< "$(slurmd -C | head -n 1)"
node=()
for field in "${hardware[@]}"; do
    case "$field" in NodeName=* | RealMemory=*) node+=("$field") ;; esac
done
CPUS=$(nproc)
[ "$CPUS" -ge 4 ] || CPUS=4
PORT=$((20000 + RANDOM % 20000))
cat > "$WORK/slurm.conf" << EOF
ClusterName=mpistrat-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$WORK/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
# Job IDs unlike earlier runs on this machine: MPICH names shared-memory segments after the
# job and step, and a segment left by a killed process of an earlier run would be reused.
FirstJobId=$((1000 + RANDOM % 50000))
${node[*]} NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=test Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$WORK/slurm.conf

KEY=/etc/munge/munge.key
if [ ! -r "$KEY" ]; then  # the package normally creates it
    KEY="$WORK/munge.key"
    dd if=/dev/urandom of="$KEY" bs=1024 count=1 status=none && chmod 400 "$KEY"
fi
say "starting munged, slurmctld, slurmd on $HOST (ports $PORT-$((PORT + 1)), $WORK)"
munged --foreground --force --key-file="$KEY" --socket="$WORK/munge.socket" --pid-file="$WORK/munged.pid" \
    --log-file="$WORK/munged.log" --seed-file="$WORK/munged.seed" > "$WORK/munged.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 50); do [ -S "$WORK/munge.socket" ] && break; sleep 0.1; done
[ -S "$WORK/munge.socket" ] || { say "munged did not start"; cat "$WORK/munged.out"; exit 1; }
slurmctld -D -f "$SLURM_CONF" > "$WORK/slurmctld.out" 2>&1 &
PIDS+=($!)
slurmd -D -f "$SLURM_CONF" > "$WORK/slurmd.out" 2>&1 &
PIDS+=($!)

state=""
for _ in $(seq 60); do
    state=$(sinfo -h -n "$HOST" -o %T 2> /dev/null || true)
    [ "$state" = idle ] && break
    sleep 1
done
[ "$state" = idle ] || { say "node $HOST is '$state', not idle, after 60 s"; exit 1; }
say "cluster up: $(sinfo -h -o '%P %D %T %C')"

# Jobs read these from the environment sbatch passes on.
export PYTHON RESULTS_DIR="$WORK/results"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# What a site that submits with --export=NONE writes into the file the jobs source first
# (JOB_SETUP): load the software (`module load`; here the venv that has mpistrat) and say where
# results go. The jobs' srun tasks must then get this environment too. A second setup hides
# matplotlib, as on a site where it is not installed.
mkdir -p "$WORK/no-matplotlib/matplotlib"
echo 'raise ImportError("No module named matplotlib")' > "$WORK/no-matplotlib/matplotlib/__init__.py"
{
    printf 'bin=%q\n' "$(dirname "$PYTHON")"
    echo 'if [ -f "$bin/activate" ]; then source "$bin/activate"; else export PATH="$bin:$PATH"; fi'
    printf 'export PYTHONPATH=%q RESULTS_DIR=%q\n' "$REPO" "$WORK/results"
} > "$WORK/setup.sh"
printf 'source %q\nexport PYTHONPATH=%q\n' "$WORK/setup.sh" "$WORK/no-matplotlib:$REPO" > "$WORK/setup-no-matplotlib.sh"

bench=$(BENCH_ARGS="--max 64KiB --iters 20 --min-iters 5" sbatch --parsable --ntasks=2 \
    --output="$WORK/results/slurm-%j.out" jobs/bench.sbatch)
say "submitted jobs/bench.sbatch: job $bench"
# The documented variant: the MPI's own mpiexec inside the allocation.
MPIEXEC=$(dirname "$PYTHON")/mpiexec
[ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec || true)
viampiexec=""
if [ -n "$MPIEXEC" ]; then
    viampiexec=$(MPI_LAUNCH="$MPIEXEC" PLOT=0 BENCH_ARGS="--ops all_reduce,all_gather_uneven --max 1KiB --iters 5" \
        sbatch --parsable --ntasks=2 --output="$WORK/results/slurm-%j.out" jobs/bench.sbatch)
    say "submitted jobs/bench.sbatch with MPI_LAUNCH=$MPIEXEC: job $viampiexec"
fi
# The checkpoint ops as WORKLOAD=checkpoint runs them: every rank writes its share in the job's file system.
checkpoints=$(PLOT=0 BENCH_ARGS="--ops checkpoint --min 256KiB --max 256KiB --leaves 4 --iters 3 --min-iters 3 \
--checkpoint-dir $WORK/checkpoint-files" sbatch --parsable --ntasks=2 --output="$WORK/results/slurm-%j.out" jobs/bench.sbatch)
say "submitted jobs/bench.sbatch --ops checkpoint: job $checkpoints"
# A series as a site with --export=NONE runs it: no PYTHON, nothing passed on but the setup file.
series=$(env -u PYTHON -u PYTHONPATH SBATCH_EXPORT=NONE JOB_SETUP="$WORK/setup.sh" \
    BENCH_ARGS="--ops train_step,all_reduce --min 256KiB --max 256KiB --iters 5 --min-iters 5 --batch 64" \
    jobs/scaling.sh strong 1 2)
echo "$series"
collect=$(echo "$series" | sed -n 's/^submitted collect: job \([0-9]*\).*/\1/p')
mapfile -t members < <(echo "$series" | sed -n 's/^submitted bench on .*: job \([0-9]*\)$/\1/p')
ids=("$bench" "$checkpoints" "${members[@]}" "$collect" ${viampiexec:+"$viampiexec"})
# One sweep with --export=NONE, 2 CPUs per task, and no matplotlib: the sweep's results, no plots.
bare=$(sbatch --parsable --ntasks=2 --cpus-per-task=2 --output="$WORK/results/slurm-%j.out" \
    --export="NONE,JOB_SETUP=$WORK/setup-no-matplotlib.sh,BENCH_ARGS=--max 4KiB --iters 5 --min-iters 5" \
    jobs/bench.sbatch)
say "submitted jobs/bench.sbatch with --export=NONE, --cpus-per-task=2 and no matplotlib: job $bare"
ids+=("$bare")
# STAGE=1: srun --ntasks-per-node=1 unpacks the environment into /dev/shm and the ranks run from
# there. The pack is the test suite's (tests/support/staged.py, made once); the setup sets no
# PYTHONPATH, which would name the repository.
STAGE_PACK=$(cd "$REPO" && PYTHONPATH="$REPO" "$PYTHON" -c "from tests.support.staged import pack; print(pack())")
{
    printf 'bin=%q\n' "$(dirname "$PYTHON")"
    echo 'source "$bin/activate"'
    printf 'export RESULTS_DIR=%q\n' "$WORK/results"
} > "$WORK/setup-staged.sh"
staged=$(sbatch --parsable --ntasks=2 --output="$WORK/results/slurm-%j.out" \
    --export="NONE,JOB_SETUP=$WORK/setup-staged.sh,STAGE=1,STAGE_PACK=$STAGE_PACK,PLOT=0,BENCH_ARGS=--ops all_reduce --max 1KiB --iters 5 --min-iters 5" \
    jobs/bench.sbatch)
say "submitted jobs/bench.sbatch with STAGE=1: job $staged"
ids+=("$staged")
# The training job with --export=NONE too.
none="NONE,JOB_SETUP=$WORK/setup.sh,TIMELINE=1,PREFLIGHT=1"
if "$PYTHON" -c "import mpistrat.examples.digits" 2> /dev/null; then
    train=$(sbatch --parsable --ntasks=2 --export="$none" --output="$WORK/results/slurm-%j.out" jobs/train.sbatch)
    say "submitted jobs/train.sbatch with --export=NONE and TIMELINE=1: job $train"
else  # the job script itself, with a module that exists here standing in for the example
    train=$(sbatch --parsable --ntasks=2 --output="$WORK/results/slurm-%j.out" \
        --export="$none,TRAIN_MODULE=mpistrat,TRAIN_ARGS=bench --ops all_reduce --max 64 --iters 2 --quiet" \
        jobs/train.sbatch)
    say "submitted jobs/train.sbatch with TRAIN_MODULE=mpistrat (mpistrat.examples.digits is not installed): job $train"
fi
ids+=("$train")

# srun without the PMI plugin MPICH speaks: every task is rank 0 of 1, and MPIStrategy() refuses;
# with MPISTRAT_ALLOW_SINGLETON=1 the same tasks run as independent one-rank jobs.
{
    echo '#!/bin/bash'
    echo 'make="import mpistrat; print(\"replicas:\", mpistrat.MPIStrategy().num_replicas_in_sync, flush=True)"'
    printf 'if srun --mpi=none %q -c "$make"; then echo "srun --mpi=none was not refused"; exit 1; fi\n' "$PYTHON"
    printf 'MPISTRAT_ALLOW_SINGLETON=1 srun --mpi=none %q -c "$make"\n' "$PYTHON"
} > "$WORK/singleton.sh"
singleton=$(sbatch --parsable --ntasks=2 --output="$WORK/results/slurm-%j.out" "$WORK/singleton.sh")
say "submitted srun --mpi=none (tasks that MPI does not join): job $singleton"
ids+=("$singleton")

# The multi-worker tutorial under srun: SlurmClusterResolver reads the step's environment
# (SLURM_PROCID, SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE), MultiWorkerMirroredStrategy
# checks it against MPI; run twice, the second run resumes from the chief's checkpoint.
multi_worker=""
if "$PYTHON" -c "import mpistrat.examples.multi_worker, sklearn" 2> /dev/null; then
    mkdir -p "$WORK/mw"
    mw_run="srun --mpi=pmi2 $PYTHON -m mpistrat.examples.multi_worker --slurm --checkpoint-dir $WORK/mw/ckpt"
    multi_worker=$(sbatch --parsable --ntasks=2 --chdir="$WORK/mw" --output="$WORK/results/slurm-%j.out" \
        --wrap "$mw_run --epochs 2 && $mw_run --epochs 3 && SLURM_CONF=$SLURM_CONF $PYTHON -m pytest -q -p no:cacheprovider \
            $REPO/tests/distribute/test_cluster_resolver.py -k agrees_with_scontrol -rs")
    say "submitted the multi-worker tutorial under srun --slurm: job $multi_worker"
    ids+=("$multi_worker")
fi

# Preemption: the same digits run twice, once left alone and once sent SIGUSR1 (as
# --signal=USR1@120 does before the time limit) while it trains; that one must save,
# requeue itself, resume in its second run and end with the same weights.
preempt_plain="" preempted=""
if "$PYTHON" -c "import mpistrat.examples.digits" 2> /dev/null; then
    export TRAIN_ARGS="--preemptible --epochs 300 --no-progress --weights-out weights.npz"
    preempt_plain=$(sbatch --parsable --ntasks=2 --output="$WORK/results/slurm-%j.out" jobs/train.sbatch)
    preempted=$(sbatch --parsable --ntasks=2 --requeue --output="$WORK/results/slurm-%j.out" jobs/train.sbatch)
    unset TRAIN_ARGS
    say "submitted jobs/train.sbatch --preemptible twice: job $preempt_plain, and job $preempted to preempt"
    ids+=("$preempt_plain" "$preempted")
    out="$WORK/results/slurm-$preempted.out"
    for _ in $(seq 240); do grep -q "watching for SIGTERM and SIGUSR1" "$out" 2> /dev/null && break; sleep 0.5; done
    grep -q "watching for SIGTERM and SIGUSR1" "$out" || { say "job $preempted never started watching"; exit 1; }
    scancel --signal=USR1 "$preempted"
    say "sent SIGUSR1 to job $preempted (scancel --signal=USR1)"
    # Slurm holds a requeued job back (Reason=BeginTime) before it may start again; release it.
    for _ in $(seq 240); do
        restarts=$(scontrol show job "$preempted" 2> /dev/null | grep -o 'Restarts=[0-9]*' || true)
        [ "$restarts" = Restarts=0 ] || break
        sleep 0.5
    done
    # Not in the same second as the requeue: slurmd refuses a credential made in the second the old
    # run's was revoked ("Killing non-startable batch job: Job credential revoked").
    sleep 2
    for _ in $(seq 240); do
        job_state=$(squeue -h -j "$preempted" -o %T 2> /dev/null || true)
        case "$job_state" in
            PENDING) scontrol update JobId="$preempted" StartTime=now 2> /dev/null || true ;;
            RUNNING | "") break ;;
        esac
        sleep 0.5
    done
fi

# A bench job whose sweep outlasts its one-minute time limit: the script's --signal=USR1@60 warns it
# (Slurm sends it up to 60 s early: here about at once), and the sweep ends after the size it is in.
# It must leave valid JSON and CSV with the rows it finished, marked partial, and plots of them.
limited=$(BENCH_ARGS="--ops all_reduce --max 64MiB --iters 20000 --min-iters 20000" sbatch --parsable --ntasks=1 \
    --time=1 --output="$WORK/results/slurm-%j.out" jobs/bench.sbatch)
say "submitted jobs/bench.sbatch --time=1 with a longer sweep: job $limited"

# A rank's death without ULFM (MPICH under srun): task 1 is SIGKILLed at step 2 of the first run;
# jobs/train.sbatch starts the run again in the same allocation, which restores the newest
# checkpoint from the ranks' node-local copies (LOCAL_COPIES=1) and ends with the weights of a run
# that lost nothing (tests/faults/survive.py); the copies are gone once the job ends.
relaunched=$(sbatch --parsable --ntasks=3 --output="$WORK/results/slurm-%j.out" \
    --export="ALL,LOCAL_COPIES=1,LOCAL_DIR=$WORK/node-local,TRAIN_MODULE=tests.faults.survive,TRAIN_ARGS=--steps 4 \
--handler --checkpoint ckpt --save-every 1 --kill 1@2@inside --kill-once $WORK/killed-once" jobs/train.sbatch)
say "submitted jobs/train.sbatch whose task 1 is killed once: job $relaunched"
ids+=("$relaunched")
# The same death under srun without --kill-on-bad-exit (Slurm leaves the others running): each
# survivor names the dead rank and its optimizer step at once, and the step ends with status 76.
{
    echo '#!/bin/bash'
    printf 'cd %q\n' "$REPO"
    printf 'srun --mpi=pmi2 --kill-on-bad-exit=0 %q -m tests.faults.survive --steps 4 --kill 1@2@inside\n' "$PYTHON"
} > "$WORK/unkilled.sh"
unkilled=$(sbatch --parsable --ntasks=3 --output="$WORK/results/slurm-%j.out" "$WORK/unkilled.sh")
say "submitted srun --kill-on-bad-exit=0 whose task 1 is killed: job $unkilled"

say "waiting for jobs ${ids[*]} $limited (at most $TIMEOUT s)"
deadline=$((SECONDS + TIMEOUT))
while [ -n "$(squeue -h -j "$(IFS=,; echo "${ids[*]},$limited,$unkilled")" 2> /dev/null)" ]; do
    [ $SECONDS -lt $deadline ] || { say "jobs still queued or running after $TIMEOUT s"; squeue; exit 1; }
    sleep 2
done

fail=0
for id in "${ids[@]}"; do
    info=$(scontrol show job "$id")
    job_state=$(echo "$info" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
    code=$(echo "$info" | grep -o ' ExitCode=[0-9:]*' | cut -d= -f2)
    say "job $id: $job_state, exit code $code"
    [ "$job_state" = COMPLETED ] && [ "$code" = 0:0 ] || fail=1
done
info=$(scontrol show job "$limited")
limited_state=$(echo "$info" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
code=$(echo "$info" | grep -o ' ExitCode=[0-9:]*' | cut -d= -f2)
say "job $limited: $limited_state, exit code $code"  # stopped by the warning (exit 75), or by the limit itself
case "$limited_state:$code" in FAILED:75:0 | TIMEOUT:*) ;; *) fail=1 ;; esac
[ $fail -eq 0 ] || exit 1
"$PYTHON" - "$WORK/results" "$limited" "$limited_state" << 'PY'
import csv, os, sys

results, job, state = sys.argv[1:]
sys.path.insert(0, os.getcwd())
from mpistrat.tools.bench_report import load

run = load(f"{results}/{job}/bench.json")  # valid JSON, of the rows measured
rows, partial = run["results"], run["meta"]["partial"]
warned = state == "FAILED"
stops = ("stopped by SIGUSR1",) if warned else ("stopped by SIGTERM", "the sweep did not finish")
assert rows and partial and partial.startswith(stops), (state, partial, len(rows))
assert all(r["mpistrat"]["ok"] and r["raw"]["ok"] for r in rows) and rows[-1]["bytes"] < 64 << 20, rows
table = list(csv.DictReader(open(f"{results}/{job}/bench.csv")))
killed = partial.startswith("the sweep did not finish")  # after Slurm's KillWait: the CSV may lack the last row
assert [int(r["bytes"]) for r in table] == [r["bytes"] for r in rows][: len(table)], (table, rows)
assert len(rows) - killed <= len(table) and all(r["partial"].startswith(stops) for r in table), table
text = open(f"{results}/{job}/bench.txt").read()  # the table, row by row through tee
assert sum(line.rstrip().endswith(("yes", "skewed")) for line in text.splitlines()) >= len(rows) - killed, text
log = open(f"{results}/slurm-{job}.out").read()
assert "\r" not in log and log.count("sizes measured (all_reduce") >= len(rows) - killed, log[-3000:]
if warned:  # the plots drawn from the rows measured
    assert os.path.exists(f"{results}/{job}/bandwidth.png"), os.listdir(f"{results}/{job}")
print(f"test-slurm: job {job} ({state}) ended early, {partial}; its {len(rows)} rows are in bench.json, "
      "bench.csv and bench.txt")
PY

"$PYTHON" - "$WORK/results" "$bench" "$collect" "$viampiexec" << 'PY'
import json, os, sys

results, bench, collect, viampiexec = sys.argv[1:]
sys.path.insert(0, os.getcwd())
from mpistrat.tools.bench_report import load

run = load(f"{results}/{bench}/bench.json")
meta, rows = run["meta"], run["results"]
assert meta["ranks"] == 2 and meta["slurm_job_id"] == bench, meta
ops = {r["op"] for r in rows}
assert {"all_reduce", "all_reduce_nest", "all_gather_uneven", "merge_call", "run_step"} <= ops, ops
bad = [(r["op"], r["bytes"]) for r in rows for s in ("mpistrat", "raw") if not r[s]["ok"]]
assert not bad, f"wrong results in the Slurm run: {bad}"
assert max(r["bytes"] for r in rows) == 64 << 10

series = open(f"{results}/{collect}/series.txt").read().split()
ranks = sorted(load(f"{results}/{j}/bench.json")["meta"]["ranks"] for j in series)
assert ranks == [1, 2], ranks
for j in series:
    m = load(f"{results}/{j}/bench.json")["meta"]
    assert m["scaling"] == "strong" and m["options"]["batch"] == 64, m

png = b"\x89PNG\r\n\x1a\n"
for path in (f"{bench}/bandwidth.png", f"{bench}/ratio.png", f"{collect}/scaling.png", f"{collect}/bandwidth.png"):
    with open(f"{results}/{path}", "rb") as f:
        assert f.read(8) == png, f"{path} is not a PNG"
lines = open(f"{results}/{collect}/all.csv").read().splitlines()
assert lines[0].startswith("op,bytes") and len(lines) == 1 + 2 * 2, lines[:3]
# mpistrat report's efficiency table: one row per rank count of the series, strong scaling
import csv
eff = list(csv.DictReader(open(f"{results}/{collect}/efficiency.csv")))
assert [int(r["ranks"]) for r in eff] == ranks, eff
assert {r["mode"] for r in eff} == {"strong"} and {r["op"] for r in eff} == {"train_step"}, eff
assert float(eff[0]["speedup"]) == 1.0 and float(eff[0]["efficiency"]) == 1.0, eff
assert all(float(r["time_us"]) > 0 and float(r["efficiency"]) > 0 for r in eff), eff
md = open(f"{results}/{collect}/efficiency.md").read()
assert "| ranks | runs | time us | speed-up | efficiency |" in md, md[:500]
# each rank count's start, its slowest rank's seconds from process start to the first collective
assert all(0 < float(r["startup_s"]) < 300 for r in eff) and "| startup s |" in md, eff
# what a number needs to be reproduced: the environment Slurm set, the CPU, each rank's binding
assert meta["environment"].get("SLURM_JOB_ID") == bench, sorted(meta["environment"])
assert meta["cpu"]["logical_cores"] and len(meta["affinity"]) == 2, (meta["cpu"], meta["affinity"])
assert all("p50" in r["mpistrat"]["time_us"] for r in rows)
if viampiexec:
    other = load(f"{results}/{viampiexec}/bench.json")
    assert other["meta"]["ranks"] == 2 and all(r["mpistrat"]["ok"] for r in other["results"]), other["meta"]
print(f"test-slurm: results check out ({len(rows)} rows at 2 ranks; series at ranks {ranks}, "
      f"efficiency.csv {len(eff)} rows; plots are PNGs)")
PY
"$PYTHON" - "$WORK/results" "$staged" "$(dirname "$(dirname "$PYTHON")")" << 'PY'
import json, os, sys

results, job, prefix = sys.argv[1:]
sys.path.insert(0, os.getcwd())
from mpistrat.tools.bench_report import load

run = load(f"{results}/{job}/bench.json")
assert all(r["mpistrat"]["ok"] for r in run["results"]), run["results"]
start = run["meta"]["startup"]
staged = f"/dev/shm/mpistrat-{job}"
env = start["environment"]  # rank 0's: its python, numpy, mpi4py and mpistrat were the staged copy's
assert env["prefix"]["path"] == f"{staged}/venv" and env["mpistrat"]["path"].startswith(staged), env
assert env["staged"]["prefix"] == os.path.realpath(prefix), env["staged"]
assert len(start["ranks"]) == 2 and all(r["points"]["first collective"] > 0 for r in start["ranks"]), start
assert not os.path.exists(staged), f"{staged} was left behind"
log = open(f"{results}/slurm-{job}.out").read()
assert f"mpistrat bench: staged" in log and "on 1 node(s)" in log, log[-2000:]
print(f"test-slurm: STAGE=1 ran both ranks from {staged}, removed at the end")
PY
"$PYTHON" - "$WORK/results" "$checkpoints" "$WORK/checkpoint-files" << 'PY'
import os, sys

results, job, files = sys.argv[1:]
sys.path.insert(0, os.getcwd())
from mpistrat.tools.bench_report import load

run = load(f"{results}/{job}/bench.json")
rows = run["results"]
assert {r["op"] for r in rows} == {"checkpoint_save", "checkpoint_restore"}, rows
assert all(r["mpistrat"]["ok"] and r["raw"]["ok"] for r in rows), rows
assert all(r["bytes"] > 3 * (256 << 10) for r in rows), [r["bytes"] for r in rows]  # parameters, Adam's slots
assert os.listdir(files) == [], os.listdir(files)  # the ops remove what they wrote
print(f"test-slurm: the checkpoint ops saved and restored at 2 ranks under srun ({rows[0]['bytes']} bytes)")
PY
"$PYTHON" - "$WORK/results" "$bare" "$singleton" << 'PY'
import os, sys

results, bare, singleton = sys.argv[1:]
sys.path.insert(0, os.getcwd())
from mpistrat.tools.bench_report import load

# --export=NONE: the setup file's venv reached the srun tasks, and the missing matplotlib cost only the plots
run = load(f"{results}/{bare}/bench.json")
assert run["meta"]["ranks"] == 2 and all(r["mpistrat"]["ok"] and r["raw"]["ok"] for r in run["results"]), run["meta"]
assert not [f for f in os.listdir(f"{results}/{bare}") if f.endswith(".png")], os.listdir(f"{results}/{bare}")
log = open(f"{results}/slurm-{bare}.out").read()
assert "mpistrat bench: no plots: python3 has no matplotlib" in log, log[-3000:]
# what the job script set (one BLAS thread per CPU of a task) reached the tasks srun started
assert run["meta"]["environment"].get("OMP_NUM_THREADS") == "2", run["meta"]["environment"]
# srun --mpi=none: refused on both tasks with the fix, then run on purpose as one-rank jobs
log = open(f"{results}/slurm-{singleton}.out").read()
refusal = "srun started 2 tasks in this job step (SLURM_STEP_NUM_TASKS=2), but MPI started this process alone"
assert log.count(refusal) == 2 and log.count("srun --mpi=pmi2") >= 2, log[-3000:]
assert log.count("replicas: 1") == 2, log[-3000:]
print("test-slurm: --export=NONE with a venv setup, no matplotlib, and srun --mpi=none refused: all as expected")
PY
"$PYTHON" - "$WORK/results/$train/train.json" << 'PY'
import json, sys

info = json.load(open(sys.argv[1]))
assert info["ranks"] == 2 and info["seconds"] > 0, info
# TIMELINE=1: both ranks' timelines merged into one trace
trace = json.load(open(sys.argv[1].replace("train.json", "trace.json")))
assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}, trace["otherData"]
# PREFLIGHT=1: mpistrat info --health ran on both tasks first (one node: nothing to compare)
health = open(sys.argv[1].replace("train.json", "health.txt")).read()
assert "health of 1 node(s), 2 rank(s)" in health and "nothing to compare" in health, health
PY
if [ -n "$multi_worker" ]; then
    "$PYTHON" - "$WORK/results/slurm-$multi_worker.out" "$WORK/mw" << 'PY'
import os, re, sys

log, work = sys.argv[1:]
out = open(log).read()
epochs = [int(e) for e in re.findall(r"^Epoch: (\d+), accuracy", out, re.M)]
assert epochs == [0, 1, 2] and "Restored ckpt-2 at epoch 2" in out, out
assert sorted(os.listdir(f"{work}/ckpt")) == ["checkpoint", "ckpt-3"], os.listdir(f"{work}/ckpt")
assert os.listdir(f"{work}/workertemp_1") == [], os.listdir(work)
assert re.search(r"^1 passed", out, re.M), f"the parser did not meet scontrol show hostnames:\n{out}"
print("test-slurm: the multi-worker tutorial ran under srun with SlurmClusterResolver, and resumed")
PY
fi
if [ -n "$preempted" ]; then
    restarts=$(scontrol show job "$preempted" | grep -o 'Restarts=[0-9]*')
    say "job $preempted: $restarts"
    [ "$restarts" = Restarts=1 ] || { say "job $preempted was not requeued once"; exit 1; }
    "$PYTHON" - "$WORK/results" "$preempt_plain" "$preempted" << 'PY'
import json, sys

results, plain, preempted = sys.argv[1:]
a = json.load(open(f"{results}/{plain}/train.json"))
b = json.load(open(f"{results}/{preempted}/train.json"))
assert a["runs"] == 1 and b["runs"] == 2, (a, b)
assert a["weights_sha256"] and a["weights_sha256"] == b["weights_sha256"], (a, b)
log = open(f"{results}/slurm-{preempted}.out").read()
for stage in ("SIGUSR1 on this rank", "saving a checkpoint", "then requeues Slurm job", "restored ", "run 2"):
    assert stage in log, f"no {stage!r} in the preempted job's output:\n{log}"
# The requeue itself: rank 0's line after scontrol returns, unless Slurm cancelled the step first
# (it does so as part of the requeue), which it then logs itself.
assert "requeued Slurm job" in log or "DUE TO JOB REQUEUE" in log, f"no requeue in the output:\n{log}"
print(f"test-slurm: job {preempted} was preempted, requeued and resumed to the uninterrupted weights")
PY
fi
"$PYTHON" - "$WORK/results" "$relaunched" << 'PY'
import json, os, re, sys

results, job = sys.argv[1:]
sys.path.insert(0, os.getcwd())
import numpy as np
from tests.distribute.test_recovery import reference

info = json.load(open(f"{results}/{job}/train.json"))
assert info["relaunched"] == 1, info
log = open(f"{results}/slurm-{job}.out").read()
assert "DYING 1 at step 2 inside" in log and "mpistrat train: a rank died (status" in log, log[-3000:]
assert re.search(r"ckpt-2 read from node-local copies \(MPISTRAT_LOCAL_COPIES\)", log), log[-3000:]
assert not os.path.exists(f"{results}/../node-local"), "the node-local copies outlived the job"
final = re.findall(r"^RESULT (\d+) (\d+) (\d+) ([0-9a-f]+)$", log, re.M)[-3:]
assert sorted((int(w), int(r), int(i)) for w, r, i, _ in final) == [(0, 3, 4), (1, 3, 4), (2, 3, 4)], final
weights = {np.frombuffer(bytes.fromhex(h), np.float32).tobytes() for *_, h in final}
assert weights == {reference(4).tobytes()}, "the relaunched run's weights differ from a run that lost nothing"
print(f"test-slurm: job {job} lost task 1, was relaunched in its allocation and ended with the uninterrupted weights")
PY
"$PYTHON" - "$WORK/results" "$unkilled" "$(scontrol show job "$unkilled")" << 'PY'
import re, sys

results, job, info = sys.argv[1:]
log = open(f"{results}/slurm-{job}.out").read()
said = re.findall(
    r"\[rank (\d)\] mpistrat: rank 1 died during optimizer step 3 \(this rank had applied 2\): its process", log
)
assert sorted(set(said)) == ["0", "2"], log[-3000:]
h, m, sec = map(int, re.search(r"RunTime=(\d+):(\d+):(\d+)", info).groups())
assert h * 3600 + m * 60 + sec < 60, info  # named at once, not at MPISTRAT_TIMEOUT
print(f"test-slurm: job {job}'s survivors named the rank srun left dead and their step, and ended")
PY
say "PASSED"
