#!/bin/bash
# make test-slurm: the sbatch scripts of examples/slurm/ under a real Slurm on this one host.
#
# Installs slurm-wlm, munge and shellcheck with apt when they are missing (fails, loudly, when
# it cannot), checks the scripts with shellcheck, writes a one-host slurm.conf in a temporary
# folder and starts munged, slurmctld and slurmd there, then (8 one-rank "nodes", so the
# scripts' default from three nodes on: etcd mode, the job starting one etcd member on each of
# its first three nodes, here three members of one host on their own ports):
#   1. pretrain_gpt_mecefo.sbatch, 8 tasks (8 one-rank "nodes", PP2 x DP4, CPU): once training
#      runs, the supervisor of node 3 is SIGKILLed (its rank dies with it: a lost node); the
#      job trains on, and rejoin_node.sh (started as a hot spare) brings node 3 back in a new
#      job step. Once that rejoin is recorded, node 0 is lost: its supervisor (the etcd
#      leader: the hot store, the coordinator and rank 0 go with it) and its etcd member m0
#      are SIGKILLed; another node wins the next term on etcd's two live members and takes
#      over, and rejoin_node.sh brings node 0 back in a second step. The job must complete
#      without a requeue, every iteration logged exactly once, one failure record for rank 3
#      and one for rank 0, a rejoin record for each, both healed, and every DP weight-hash
#      check identical up to the last iteration.
#   2. megatron_lm_mecefo.sbatch, 8 tasks, Megatron-LM core_v0.16.1 (MEGATRON_LM_DIR, else the
#      tarball in ../shared/megatron-lm, unpacked and patched): the same losses of node 3 and
#      node 0 and their rejoins as 1, survived in-process in Megatron-LM's own pretrain_gpt.py:
#      no requeue, no checkpoint read, both nodes healed, Megatron-LM's weight-hash check
#      passing at the end. With neither, the script must fail under Slurm with its own
#      message, and this says loudly that the Megatron-LM run was not exercised.
#   3. pretrain_gpt_mecefo.sbatch cut by its time limit: once training runs, the job's limit is
#      lowered so that Slurm's --signal=TERM@120 (the script's own) falls due; the ranks save
#      at the next iteration boundary, the script requeues the job, and the requeued job
#      resumes from that checkpoint: every iteration is logged exactly once across the two.
#   4. etcd's quorum lost: pretrain_gpt_mecefo.sbatch on 4 one-rank nodes (PP2 x DP2, the
#      job's own etcd), two of its three etcd members SIGKILLed after a checkpoint: every
#      supervisor ends with one line, no hang; the script requeues the job, which starts a
#      fresh etcd, resumes from the checkpoint and completes. STORE_MODE=replicated (an old
#      configuration) must fail with its own line.
# A requeue after a failure remains for losing every replica (not exercised here) and etcd's
# quorum (4).
# Every daemon and job it started is stopped by PID / job id, and the folder removed, on exit.
set -euo pipefail
# No `cmd | grep -q`: grep exits at the first match, cmd then dies of SIGPIPE, and pipefail
# turns a found line into a failure (seen once: "no heal line in the log" with the line there).

REPO=$(cd "$(dirname "$0")/../../.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
T0=$(date +%s)
say() { echo "[test-slurm $(($(date +%s) - T0))s] $*"; }
# The reason is said again as the cleanup's last line: CI shows only an output's tail, which the
# daemons' logs below would fill.
FAILED_WHY=
fail() { FAILED_WHY=$*; echo "[test-slurm] FAILED: $*" >&2; exit 1; }

# ------------------------------------------------------------------ install
need=()
for tool in slurmctld:slurm-wlm slurmd:slurm-wlm sbatch:slurm-wlm munged:munge shellcheck:shellcheck; do
    command -v "${tool%%:*}" > /dev/null 2>&1 || need+=("${tool##*:}")
done
if [ "${#need[@]}" -gt 0 ]; then
    mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get > /dev/null; then
        fail "missing ${need[*]} and cannot install them here (needs root and apt-get); install" \
            "them (Debian/Ubuntu: apt-get install slurm-wlm munge shellcheck) and rerun"
    fi
    say "installing ${need[*]} with apt-get"
    t=$(date +%s)
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" \
        > /dev/null
    say "apt-get install took $(($(date +%s) - t)) s"
fi
"$PY" -c "import megatron_mecefo" || fail "$PY cannot import megatron_mecefo (run make venv)"

say "shellcheck examples/slurm tests/integration/slurm"
shellcheck "$REPO"/examples/slurm/*.sh "$REPO"/examples/slurm/*.sbatch "$REPO"/tests/integration/slurm/*.sh

# ------------------------------------------------------------------ a one-host cluster
TMP=$(mktemp -d /tmp/mecefo-slurm.XXXXXX)
chmod 711 "$TMP"
DAEMONS=()
JOBS=()
cleanup() {
    local rc=$?
    set +e
    local pids=()
    for job in "${JOBS[@]}"; do  # every process of the job's steps (proctrack/linuxproc)
        mapfile -t -O "${#pids[@]}" pids < <(scontrol listpids "$job" 2> /dev/null | awk 'NR > 1 {print $1}')
        scancel "$job" 2> /dev/null
    done
    for job in "${JOBS[@]}"; do  # its processes end before slurmd does
        for _ in $(seq 100); do
            grep -q . <<< "$(squeue -h -j "$job" 2> /dev/null)" || break
            sleep 0.2
        done
    done
    for pid in "${pids[@]}"; do kill -9 "$pid" 2> /dev/null; done
    for pid in "${DAEMONS[@]}"; do kill "$pid" 2> /dev/null; done
    for pid in "${DAEMONS[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2> /dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2> /dev/null
    done
    if [ "$rc" -ne 0 ]; then
        # A rank's own error, if one died of one: its traceback from the jobs' outputs.
        for out in "$TMP"/runs/*.out; do
            [ -f "$out" ] || continue
            echo "---- tracebacks in $(basename "$out")"
            grep -v "^\[rank[0-9]*\]:\[W\|^frame #\|^Exception raised from" "$out" \
                | grep -A 25 "^Traceback" | head -n 120
        done
        for out in "$TMP"/runs/*.out; do
            [ -f "$out" ] || continue
            echo "---- supervisor, coordinator and job lines in $(basename "$out") (tail)"
            grep -E "^\[(supervisor|coordinator|mecefo_node|etcd_member)|MeCeFO|^etcd|^error|^note" "$out" \
                | tail -n 40 | cut -c1-300
        done
        echo "---- slurmctld log (tail)"; tail -n 20 "$TMP/slurmctld.log" 2> /dev/null
        echo "---- slurmd log (tail)"; tail -n 20 "$TMP/slurmd.log" 2> /dev/null
    fi
    # SLURM_TEST_KEEP=DIR: the jobs' run folders and outputs are copied there (also on success:
    # the recovery records and supervisor lines of a passing run).
    if [ -n "${SLURM_TEST_KEEP:-}" ]; then
        cp -r "$TMP/runs" "$SLURM_TEST_KEEP"
        cp "$TMP"/slurm*.log "$SLURM_TEST_KEEP" 2> /dev/null
    fi
    rm -rf "$TMP"
    say "stopped ${#DAEMONS[@]} daemons, removed $TMP (status $rc)"
    if [ -n "$FAILED_WHY" ]; then echo "[test-slurm] FAILED: $FAILED_WHY" >&2; fi
}
trap cleanup EXIT
# A check that fails without fail() (set -e: an inline Python check's assertion) is named by line.
trap 'FAILED_WHY=${FAILED_WHY:-"the command at line $LINENO exited $? (its own error is above)"}' ERR
trap 'exit 130' INT TERM

free_port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('',0)); print(s.getsockname()[1])"; }
HOST=$(hostname -s)
mkdir -p "$TMP/munge" "$TMP/state" "$TMP/spool" "$TMP/runs"
chmod 700 "$TMP/munge"
head -c 1024 /dev/urandom > "$TMP/munge/munge.key"
chmod 400 "$TMP/munge/munge.key"
# Slurm refuses more tasks on a node than it has CPUs: the node claims max(nproc, 8) CPUs
# (config_overrides), i.e. the 8 tiny CPU ranks oversubscribe the real cores.
CPUS=$(nproc)
[ "$CPUS" -ge 8 ] || CPUS=8
cat > "$TMP/slurm.conf" << CONF
ClusterName=mecefotest
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$TMP/munge/munge.sock,cred_expire=20
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
StateSaveLocation=$TMP/state
SlurmdSpoolDir=$TMP/spool
SlurmctldPidFile=$TMP/slurmctld.pid
SlurmdPidFile=$TMP/slurmd.pid
SlurmctldLogFile=$TMP/slurmctld.log
SlurmdLogFile=$TMP/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=5
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=test Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
export SLURM_CONF=$TMP/slurm.conf
munged -F --force --socket="$TMP/munge/munge.sock" --key-file="$TMP/munge/munge.key" \
    --pid-file="$TMP/munge/munged.pid" --log-file="$TMP/munged.log" --seed-file="$TMP/munge/seed" \
    > "$TMP/munged.out" 2>&1 &
DAEMONS+=($!)
slurmctld -D -f "$SLURM_CONF" > "$TMP/slurmctld.out" 2>&1 &
DAEMONS+=($!)
slurmd -D -f "$SLURM_CONF" > "$TMP/slurmd.out" 2>&1 &
DAEMONS+=($!)
for _ in $(seq 150); do
    state=$(sinfo -h -N -o %T 2> /dev/null || true)
    [ "$state" = idle ] && break
    sleep 0.2
done
[ "$state" = idle ] || fail "the one-host cluster did not come up (node state '$state')"
say "munged, slurmctld, slurmd up (pids ${DAEMONS[*]}), node $HOST with $CPUS CPUs"

job_state() { scontrol show job "$1" 2> /dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
# A job's requeue count (scontrol's Restarts=N), read until slurmctld answers (it may not, for a
# moment, as a job ends: one such read failed a CI run that had requeued exactly once), else
# "unknown"; the caller's failure names the value and the job's own (restart N) lines.
job_restarts() {
    local out n
    for _ in $(seq 40); do
        out=$(scontrol show job "$1" 2> /dev/null || true)
        n=$(grep -o 'Restarts=[0-9]*' <<< "$out" | cut -d= -f2 || true)
        [ -n "$n" ] && { echo "$n"; return; }
        sleep 0.5
    done
    echo unknown
}
expect_restarts() {  # JOB N OUT WHY
    local n
    n=$(job_restarts "$1")
    [ "$n" = "$2" ] || fail "$4 (scontrol: Restarts=$n, expected $2; the job's runs:" \
        "$(grep -o "MeCeFO job $1 (restart [0-9]*)" "$3" | tr '\n' ' '))"
}
wait_job_end() {  # JOB TIMEOUT_S -> $STATE (not a $(...) subshell: a signal reaches the trap)
    local end=$(($(date +%s) + $2))
    while [ "$(date +%s)" -lt "$end" ]; do
        STATE=$(job_state "$1")
        case $STATE in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY) return;; esac
        sleep 1
    done
    STATE="STILL-$STATE"
}
wait_for_text() {  # FILE TEXT TIMEOUT_S
    local end=$(($(date +%s) + $3))
    while [ "$(date +%s)" -lt "$end" ]; do
        grep -qF -- "$2" "$1" 2> /dev/null && return 0
        sleep 0.5
    done
    return 1
}
# Six free ports in a row below the ephemeral range (no client connection takes one meanwhile):
# the job's own etcd members, three on this one host (clients BASE..BASE+2, peers +3..+5).
free_block() {
    "$PY" - << 'PYPORTS'
import random, socket
for _ in range(200):
    base = random.randrange(20000, 32000)
    try:
        for port in range(base, base + 6):
            with socket.socket() as s:
                s.bind(("", port))
    except OSError:
        continue
    print(base)
    break
PYPORTS
}
submit() {  # OUT SCRIPT [NTASKS]  (env passed through; each job gets free ports for its stores)
    local id base n=${3:-8}
    base=$(free_block)
    id=$(STORE_PORT=$(free_port) MECEFO_ETCD_CLIENT_PORT=$base MECEFO_ETCD_PEER_PORT=$((base + 3)) \
        sbatch --parsable -N1 -n"$n" --ntasks-per-node="$n" --gpus-per-node=0 -o "$1" "$2")
    JOBS+=("$id")
    echo "$id"
}
etcd_started() {  # OUT: the job started its own 3 etcd members, and the supervisors use them
    grep -q "etcd: the job's own 3 members" "$1" || { tail -n 30 "$1"; fail "no etcd started by the job in $1"; }
    grep -q "(etcd, etcd " "$1" || { tail -n 30 "$1"; fail "the job in $1 did not run in etcd mode"; }
}

wait_rejoin_of_3() {  # RECORDS_FILE TIMEOUT_S: until a recovery record has rank 3 joined
    local joined='"ranks_joined": \[([0-9]+, )*3[],]'
    for _ in $(seq $(($2 * 2))); do
        grep -Eq "$joined" "$1" 2> /dev/null && return 0
        sleep 0.5
    done
    tail -n 30 "$OUT"
    fail "node 3's rejoin was never recorded in $1"
}
standby_warm() {  # node 3's rejoin standby (in $RUN/pids.node3) connected to the store: imported
    local pid
    pid=$(awk '$1 == -1 {print $3}' "$RUN/pids.node3" 2> /dev/null | tail -n 1)
    [ -n "$pid" ] && grep -q . <<< "$(find "/proc/$pid/fd" -lname 'socket:*' 2> /dev/null)"
}

wait_takeover() {  # FILES...: a takeover line within 120 s, in the job's output or a rejoin
    # step's (a rejoined node campaigns too, and may win the term)
    for _ in $(seq 240); do
        grep -qF "takes over" "$@" 2> /dev/null && return 0
        sleep 0.5
    done
    return 1
}
lose_node0() {  # node 0's supervisor (with its rank) and its host's etcd member m0, SIGKILLed
    local sup member
    sup=$(cat "$RUN/supervisor.node0.pid")
    member=$(cat "$RUN/etcd/m0.pid")
    grep -E "iteration +[0-9]+/" "$OUT" | tail -n 1 | cut -c1-60
    kill -9 "$sup" "$member"
    say "SIGKILLed node 0: its supervisor (pid $sup; the leader's hot store, coordinator and rank 0 die with it) and etcd member m0 (pid $member)"
}

# The tiny CPU run both scripts train (8 ranks, PP2 x DP4).
# PYTHONPATH: the ranks import this checkout's megatron_mecefo (the venv's editable install may
# be another checkout's, e.g. in a git worktree).
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export PYTHON=$PY GPUS_PER_NODE=1 TP=1 PP=2 DEVICE=cpu OMP_NUM_THREADS=1
export SUPERVISOR_ARGS="--heartbeat-interval 0.5 --heartbeat-timeout 6 --collective-timeout 25 --init-timeout 90"

# ------------------------------------------------------------------ 1. the example trainer
# SLURM_TEST_PARTS=gpt,mlm,timelimit,quorum (default all four) runs only the parts named.
PARTS=${SLURM_TEST_PARTS:-gpt,mlm,timelimit,quorum}
if [[ ,$PARTS, == *,gpt,* ]]; then
# The example trainer through tests/workers/dump_trainer.py, which only adds a sleep per
# iteration (MECEFO_TEST_STEP_SLEEP) so that the run outlasts both losses and returns.
ITERS=${SLURM_TEST_ITERS:-150}
RUN=$TMP/runs/gpt
OUT=$TMP/runs/gpt.out
export RUN_DIR=$RUN MECEFO_DIR=$REPO TRAINER=$REPO/tests/workers/dump_trainer.py \
    MECEFO_TEST_STEP_SLEEP=${SLURM_TEST_STEP_SLEEP:-0.3} DATA_PATH=mock PRECISION_ARGS="" \
    MODEL_ARGS="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64" \
    MICRO_BATCH=2 GLOBAL_BATCH=16 TRAIN_ITERS=$ITERS SAVE_INTERVAL=$ITERS \
    EXTRA_ARGS="--mecefo-rank 16 --log-interval 1 --eval-iters 0 --split 98,2,0 --lr 3e-3 \
--lr-decay-style constant --check-weight-hash-across-dp-replicas-interval 10"
JOB=$(submit "$OUT" "$REPO/examples/slurm/pretrain_gpt_mecefo.sbatch")
say "job $JOB: pretrain_gpt_mecefo.sbatch, 8 tasks, $ITERS iterations"
# 8 nodes: etcd mode by default, the job's own 3 etcd members; node 0 is elected first.
wait_for_text "$OUT" "elected leader on etcd" 300 || { tail -n 30 "$OUT"; fail "job $JOB never started (no leader elected on etcd)"; }
etcd_started "$OUT"
# The replacement node is started with the job (a hot spare): its supervisor starts a warm
# standby that imports everything while the job starts, then waits until node 3's rank is
# known dead, and takes its slot about a second later.
"$REPO/examples/slurm/rejoin_node.sh" --standby 1 "$RUN" 3 > "$TMP/runs/rejoin.out" 2>&1 &
rejoin=$!
wait_for_text "$OUT" "iteration        3/" 300 || { tail -n 30 "$OUT"; fail "job $JOB never reached iteration 3"; }
victim=$(cat "$RUN/supervisor.node3.pid")
for _ in $(seq 600); do standby_warm && break; sleep 0.5; done
standby_warm || { cat "$TMP/runs/rejoin.out"; fail "the rejoining node's standby never came up"; }
grep -E "iteration +[0-9]+/" "$OUT" | tail -n 1 | cut -c1-60
kill -9 "$victim"
say "SIGKILLed node 3's supervisor (pid $victim; its rank 3 dies with it): a lost node"
# Node 0 next (the etcd leader: the hot store, the coordinator and rank 0, and the etcd
# member m0 on its host), once node 3's rejoin is recorded (its generation committed an
# iteration): another node wins the next term on the two live members and takes over, and a
# new node 0 rejoins.
wait_rejoin_of_3 "$RUN/metrics.jsonl" 300
lose_node0
wait_takeover "$OUT" "$TMP/runs/rejoin.out" || { tail -n 30 "$OUT"; fail "no node took over after the leader's (node 0's) loss"; }
say "$(grep -ho "node [0-9]*\] leader node 0 lost.*takes over" "$OUT" "$TMP/runs/rejoin.out" | head -n 1 | cut -c1-90); node 0 rejoins"
"$REPO/examples/slurm/rejoin_node.sh" "$RUN" 0 > "$TMP/runs/rejoin0.out" 2>&1 &
rejoin0=$!
wait_job_end "$JOB" 600
state=$STATE
wait "$rejoin" && rejoin_rc=0 || rejoin_rc=$?
wait "$rejoin0" && rejoin0_rc=0 || rejoin0_rc=$?
say "job $JOB: $state; rejoin steps' exit status: node 3 $rejoin_rc, node 0 $rejoin0_rc"
echo "---- job output (recovery lines)"
grep -E "MeCeFO (recovery|job)|supervisor node|rejoin|coordinator|dp weight|requeue" "$OUT" | cut -c1-220 || true
for node in 3 0; do
    f=$TMP/runs/rejoin.out
    [ "$node" = 0 ] && f=$TMP/runs/rejoin0.out
    echo "---- rejoin step of node $node"
    grep -v "^ *\[.*iteration\|Warning\|warnings.warn" "$f" | cut -c1-220 || true
done
[ "$state" = COMPLETED ] || { tail -n 40 "$OUT"; fail "job $JOB ended $state"; }
[ "$rejoin_rc" -eq 0 ] || fail "node 3's rejoin step exited $rejoin_rc"
[ "$rejoin0_rc" -eq 0 ] || fail "node 0's rejoin step exited $rejoin0_rc"
expect_restarts "$JOB" 0 "$OUT" "job $JOB was requeued: a loss was not survived in-process"
grep -q "requeued" "$OUT" && fail "job $JOB requeued itself: a loss was not survived in-process"
grep -q "(restart 0)" "$OUT" || fail "job $JOB did not start as restart 0"
"$PY" - "$RUN/metrics.jsonl" "$ITERS" "$OUT" "$TMP/runs/rejoin.out" "$TMP/runs/rejoin0.out" << 'PYCHECK'
import json, sys
metrics, iters, logs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
recs = [json.loads(line) for line in open(metrics) if line.strip()]
train = sorted(r["iteration"] for r in recs if r["type"] == "train")
assert train == list(range(1, iters + 1)), f"iterations logged: {train}"
rec = [r for r in recs if r["type"] == "recovery"]
fail = [r for r in rec if r["kind"] == "failure"]
# A rank's new process joins in a rejoin generation, or in the failure's own generation when
# its warm standby is up before the coordinator has declared the old one dead (a race).
# One failure record per lost node (rank 3, then rank 0), one rejoin record for each.
lost = [r["ranks_lost"] for r in fail if r["ranks_lost"]]
assert lost == [[3], [0]], f"failure records lost {lost}, not [[3], [0]]: {rec}"
lost = {n: [r for r in fail if r["ranks_lost"] == [n]] for n in (3, 0)}
join = {n: [r for r in rec if n in r["ranks_joined"]] for n in (3, 0)}
for n in (3, 0):
    assert len(join[n]) == 1, f"{len(join[n])} rejoin records of rank {n}: {rec}"
checks = [r for r in recs if r["type"] == "dp_weight_check"]
assert checks and all(c["identical"] for c in checks), f"DP weight-hash checks: {checks}"
assert max(c["iteration"] for c in checks) == iters, f"no check at the last iteration: {checks}"
text = "".join(open(p, errors="replace").read() for p in logs)
heals = text.count("healed; parameters and optimizer state identical")
assert heals >= 2, f"{heals} heal line(s) in the logs, not one per rejoined node"
assert "takes over" in text, "no takeover line after the leader's loss"
for n in (3, 0):
    print(f"[test-slurm] example trainer: node {n} lost at iteration {lost[n][0]['iteration']} "
          f"(ranks lost {lost[n][0]['ranks_lost']}), rejoined at iteration "
          f"{join[n][-1]['iteration']} (ranks {join[n][-1]['ranks_joined']}, in a "
          f"{join[n][-1]['kind']} generation)")
print(f"[test-slurm] example trainer: {iters} iterations each logged once; {heals} heal lines; "
      f"{len(checks)} DP weight-hash checks identical (last at iteration {iters})")
PYCHECK
say "pretrain_gpt_mecefo.sbatch: PASSED"
fi

# ------------------------------------------------------------------ 2. Megatron-LM
if [[ ,$PARTS, == *,mlm,* ]]; then
RUN=$TMP/runs/mlm
OUT=$TMP/runs/mlm.out
export RUN_DIR=$RUN
# Megatron-LM core_v0.16.1: MEGATRON_LM_DIR, else the tarball beside the project (CI's copy
# of shared/), unpacked here and patched.
TARBALL=$REPO/../shared/megatron-lm/Megatron-LM-core_v0.16.1.tar.gz
if [ -z "${MEGATRON_LM_DIR:-}" ] && [ -f "$TARBALL" ]; then
    tar xzf "$TARBALL" -C "$TMP"
    MEGATRON_LM_DIR=$TMP/Megatron-LM-core_v0.16.1
    # GIT_CEILING_DIRECTORIES: inside another git work tree, git apply would apply nothing.
    (cd "$MEGATRON_LM_DIR" && GIT_CEILING_DIRECTORIES=$TMP git apply "$REPO/patches/megatron-lm-core_v0.16.1.patch")
    grep -q megatron_mecefo "$MEGATRON_LM_DIR/pretrain_gpt.py" || fail "the patch did not apply to $MEGATRON_LM_DIR"
    export MEGATRON_LM_DIR
    say "Megatron-LM core_v0.16.1 from $TARBALL, patched, in $MEGATRON_LM_DIR"
fi
if [ -z "${MEGATRON_LM_DIR:-}" ]; then
    JOB=$(submit "$OUT" "$REPO/examples/slurm/megatron_lm_mecefo.sbatch")
    wait_job_end "$JOB" 60
    state=$STATE
    cat "$OUT"
    [ "$state" = FAILED ] || fail "megatron_lm_mecefo.sbatch without MEGATRON_LM_DIR ended $state, not FAILED"
    grep -q "error: MEGATRON_LM_DIR=<unset>: no Megatron-LM pretrain_gpt.py there" "$OUT" \
        || fail "megatron_lm_mecefo.sbatch failed without its own message"
    echo "########################################################################################"
    echo "# megatron_lm_mecefo.sbatch: NOT EXERCISED (no MEGATRON_LM_DIR, no tarball in          #"
    echo "# ../shared/megatron-lm). Only checked that it fails under Slurm with its own message. #"
    echo "########################################################################################"
else
    # The same node loss and rejoin as part 1, in Megatron-LM's own pretrain_gpt.py: the job
    # must train on in-process (no requeue, no checkpoint read), heal the rejoined node and
    # pass Megatron-LM's own weight-hash check across the data-parallel replicas.
    # 450: node 0's replacement (a rejoin step: start, import, compile, heal) rejoined at
    # iteration 111 of 300 on an idle machine, and once not before the 300th at all.
    MLM_ITERS=${SLURM_TEST_MLM_ITERS:-450}
    export GPT_ARGS="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 16 --lr 1e-3 \
--lr-decay-style constant --train-iters $MLM_ITERS --hidden-dropout 0 --attention-dropout 0 \
--ckpt-format torch --num-workers 0" \
        DATA_ARGS="--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --seed 1234" \
        OUTPUT_ARGS="--log-interval 10 --save-interval $MLM_ITERS --eval-iters 0 --eval-interval 100000 \
--check-weight-hash-across-dp-replicas-interval 50" \
        EXTRA_ARGS="--mecefo-rank 16"
    JOB=$(submit "$OUT" "$REPO/examples/slurm/megatron_lm_mecefo.sbatch")
    say "job $JOB: megatron_lm_mecefo.sbatch ($MEGATRON_LM_DIR), 8 tasks, $MLM_ITERS iterations"
    wait_for_text "$OUT" "elected leader on etcd" 300 || { tail -n 30 "$OUT"; fail "job $JOB never started"; }
    etcd_started "$OUT"
    "$REPO/examples/slurm/rejoin_node.sh" --standby 1 "$RUN" 3 > "$TMP/runs/mlm-rejoin.out" 2>&1 &
    rejoin=$!
    wait_for_text "$OUT" "iteration       10/" 300 || { tail -n 30 "$OUT"; fail "job $JOB never reached iteration 10"; }
    for _ in $(seq 600); do standby_warm && break; sleep 0.5; done
    standby_warm || { cat "$TMP/runs/mlm-rejoin.out"; fail "the rejoining node's standby never came up"; }
    victim=$(cat "$RUN/supervisor.node3.pid")
    kill -9 "$victim"
    say "SIGKILLed node 3's supervisor (pid $victim; its rank 3 dies with it): a lost node"
    # Then node 0 (with etcd member m0), once node 3's rejoin is recorded; another node takes over.
    wait_rejoin_of_3 "$RUN/recovery.jsonl" 600
    lose_node0
    wait_takeover "$OUT" "$TMP/runs/mlm-rejoin.out" || { tail -n 30 "$OUT"; fail "no node took over after the leader's (node 0's) loss"; }
    "$REPO/examples/slurm/rejoin_node.sh" "$RUN" 0 > "$TMP/runs/mlm-rejoin0.out" 2>&1 &
    rejoin0=$!
    say "$(grep -ho "node [0-9]*\] leader node 0 lost.*takes over" "$OUT" "$TMP/runs/mlm-rejoin.out" | head -n 1 | cut -c1-90); node 0 rejoins"
    wait_job_end "$JOB" 900
    state=$STATE
    wait "$rejoin" && rejoin_rc=0 || rejoin_rc=$?
    wait "$rejoin0" && rejoin0_rc=0 || rejoin0_rc=$?
    say "job $JOB: $state; rejoin steps' exit status: node 3 $rejoin_rc, node 0 $rejoin0_rc"
    echo "---- job output (recovery lines)"
    grep -E "MeCeFO (recovery|Megatron-LM job)|supervisor node|Weight hashes|loaded checkpoint" "$OUT" | cut -c1-220 || true
    for f in mlm-rejoin mlm-rejoin0; do
        echo "---- rejoin step ($f)"
        grep -E "MeCeFO|supervisor|mecefo_node|Weight hashes" "$TMP/runs/$f.out" | cut -c1-220 || true
    done
    [ "$state" = COMPLETED ] || { tail -n 40 "$OUT"; fail "job $JOB ended $state"; }
    [ "$rejoin_rc" -eq 0 ] || fail "node 3's rejoin step exited $rejoin_rc"
    [ "$rejoin0_rc" -eq 0 ] || fail "node 0's rejoin step exited $rejoin0_rc"
    expect_restarts "$JOB" 0 "$OUT" "job $JOB was requeued: the loss was not survived in-process"
    # Rank 0 prints the weight-hash checks: after node 0's rejoin, to its rejoin step's output.
    logs=("$OUT" "$TMP/runs/mlm-rejoin.out" "$TMP/runs/mlm-rejoin0.out")
    grep -q "iteration *$MLM_ITERS/ *$MLM_ITERS" "${logs[@]}" || fail "Megatron-LM did not reach iteration $MLM_ITERS"
    grep -Eq "pretrain\(\) re-entered in generation [0-9]+; no checkpoint read" "${logs[@]}" \
        || fail "no in-process re-entry of pretrain() after the loss"
    grep -q "successfully loaded checkpoint" "${logs[@]}" && fail "a checkpoint was read"
    heals=$(cat "${logs[@]}" | grep -c "healed; parameters and optimizer state identical" || true)
    [ "$heals" -ge 2 ] || fail "$heals heal line(s) in the logs, not one per rejoined node"
    grep -q "Weight hashes match after $MLM_ITERS iterations" "${logs[@]}" \
        || fail "no passing weight-hash check at iteration $MLM_ITERS"
    grep -q "do not match" "${logs[@]}" && fail "a weight-hash check failed"
    "$PY" - "$RUN/recovery.jsonl" << 'PYCHECK'
import json, sys
rec = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
rec = [r for r in rec if r.get("type") == "recovery"]
fail = [r for r in rec if r["kind"] == "failure" and r["ranks_lost"]]
assert [r["ranks_lost"] for r in fail] == [[3], [0]], f"failures, not of [3] then [0]: {rec}"
for n, lost in zip((3, 0), fail):
    join = [r for r in rec if n in r["ranks_joined"]]
    assert len(join) == 1, f"{len(join)} rejoin records of rank {n}: {rec}"
    print(f"[test-slurm] Megatron-LM: node {n} lost at iteration {lost['iteration']} (ranks "
          f"lost {lost['ranks_lost']}), rejoined at iteration {join[0]['iteration']} (ranks "
          f"{join[0]['ranks_joined']}, in a {join[0]['kind']} generation)")
PYCHECK
    say "megatron_lm_mecefo.sbatch ($MEGATRON_LM_DIR): PASSED (nodes 3 and 0 lost and rejoined in-process, no requeue)"
fi
fi

# ------------------------------------------------------------------ 3. cut by the time limit
if [[ ,$PARTS, == *,timelimit,* ]]; then
TL_ITERS=${SLURM_TEST_TL_ITERS:-300}
RUN=$TMP/runs/timelimit
OUT=$TMP/runs/timelimit.out
CKPT=$RUN/checkpoints
export RUN_DIR=$RUN MECEFO_DIR=$REPO TRAINER=$REPO/tests/workers/dump_trainer.py \
    MECEFO_TEST_STEP_SLEEP=0.2 DATA_PATH=mock PRECISION_ARGS="" \
    MODEL_ARGS="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64" \
    MICRO_BATCH=2 GLOBAL_BATCH=16 TRAIN_ITERS=$TL_ITERS SAVE_INTERVAL=100000 \
    EXTRA_ARGS="--mecefo-rank 16 --log-interval 10 --eval-iters 0 --split 98,2,0 --lr 3e-3 \
--lr-decay-style constant"
JOB=$(submit "$OUT" "$REPO/examples/slurm/pretrain_gpt_mecefo.sbatch")
say "job $JOB: pretrain_gpt_mecefo.sbatch, 8 tasks, $TL_ITERS iterations, to be cut by its time limit"
wait_for_text "$OUT" "iteration       10/" 300 || { tail -n 30 "$OUT"; fail "job $JOB never reached iteration 10"; }
# The limit (whole minutes) that puts the end 60-120 s from now: the script's SIGTERM, due
# 120 s before the end, is sent at slurmctld's next time-limit pass (every 30 s), and the
# ranks then have at least 30 s to save before the job would be killed.
elapsed=$(($(date +%s) - $(date -d "$(scontrol show job "$JOB" | grep -o 'StartTime=[^ ]*' | cut -d= -f2)" +%s)))
limit=$(((elapsed + 120) / 60))
scontrol update JobId="$JOB" TimeLimit="$limit"
say "job $JOB: time limit lowered to $limit min after $elapsed s (SIGTERM due now, the end in $((limit * 60 - elapsed)) s)"
# Requeued: raise the limit again before the new run can be signalled, so that it finishes.
for _ in $(seq 600); do
    grep -q "Restarts=1" <<< "$(scontrol show job "$JOB" 2> /dev/null)" && break
    sleep 0.5
done
[ "$(job_restarts "$JOB")" = 1 ] || { tail -n 40 "$OUT"; fail "job $JOB was not requeued after its time-limit signal"; }
# (Slurm holds a requeued job back until the old job's credential expires, cred_expire in
# AuthInfo above, 120 s by default; releasing it sooner gets it killed as "credential revoked".)
scontrol update JobId="$JOB" TimeLimit=30
say "job $JOB requeued; its time limit raised back to 30 min"
wait_job_end "$JOB" 600
say "job $JOB: $STATE"
echo "---- job output (stop, requeue, resume)"
grep -E "MeCeFO job|SIGTERM|supervisor node|stopped by|exiting at|loaded checkpoint|training finished" "$OUT" | cut -c1-220 || true
[ "$STATE" = COMPLETED ] || { tail -n 40 "$OUT"; fail "job $JOB ended $STATE"; }
saved=$(grep -o "stopped before the time limit and saved iteration [0-9]*" "$OUT" | grep -o "[0-9]*$") \
    || fail "job $JOB: no save-and-requeue line"
if [ "$saved" -lt 10 ] || [ "$saved" -ge "$TL_ITERS" ]; then
    fail "the stop saved iteration $saved (expected 10..$((TL_ITERS - 1)))"
fi
grep -q "loaded checkpoint from $CKPT at iteration $saved " "$OUT" || fail "the requeued run did not resume at iteration $saved"
grep -q "ranks ended before their save completed" "$OUT" && fail "a rank ended before its save"
# The signal went to the batch script only (--signal=B:), which passed it to the training step:
# the job's etcd members kept serving while the ranks saved (no supervisor lost its lease).
grep -q "SIGTERM before the time limit: passed on to the training steps" "$OUT" || fail "the script did not pass the signal on"
grep -Eq "^\[supervisor node [0-9]+\] .*exiting \(the other nodes" "$OUT" && fail "a supervisor lost etcd while stopping"
"$PY" - "$RUN/metrics.jsonl" "$TL_ITERS" "$saved" << 'PYCHECK'
import json, sys
metrics, iters, saved = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
recs = [json.loads(line) for line in open(metrics) if line.strip()]
train = [r["iteration"] for r in recs if r["type"] == "train"]
assert train == list(range(1, iters + 1)), f"iterations logged: {train}"
assert not [r for r in recs if r["type"] == "recovery"], "the stop was recovered as a failure"
print(f"[test-slurm] time limit: stopped and saved at iteration {saved}, requeued, resumed there; "
      f"iterations 1..{iters} each logged exactly once across the two runs")
PYCHECK
say "pretrain_gpt_mecefo.sbatch cut by its time limit: PASSED (saved, requeued, resumed)"
fi
# ------------------------------------------------------------------ 4. etcd's quorum lost
if [[ ,$PARTS, == *,quorum,* ]]; then
# An old configuration's STORE_MODE=replicated: one error line naming it and the fix, and no
# step started.
OUT=$TMP/runs/replicated.out
export RUN_DIR=$TMP/runs/replicated MECEFO_DIR=$REPO DATA_PATH=mock
JOB=$(STORE_MODE=replicated submit "$OUT" "$REPO/examples/slurm/pretrain_gpt_mecefo.sbatch" 4)
wait_job_end "$JOB" 60
[ "$STATE" = FAILED ] || { cat "$OUT"; fail "STORE_MODE=replicated: job $JOB ended $STATE, not FAILED"; }
grep -q "^error: STORE_MODE=replicated: .*MECEFO_ETCD_ENDPOINTS=HOST:PORT" "$OUT" \
    || { cat "$OUT"; fail "STORE_MODE=replicated: not the error line naming it and the fix"; }
[ "$(wc -l < "$OUT")" -eq 1 ] || { cat "$OUT"; fail "STORE_MODE=replicated: more than its one line"; }
say "STORE_MODE=replicated: FAILED with its own line: $(cut -c1-100 "$OUT")..."

Q_ITERS=${SLURM_TEST_Q_ITERS:-60}
RUN=$TMP/runs/quorum
OUT=$TMP/runs/quorum.out
CKPT=$RUN/checkpoints
export RUN_DIR=$RUN MECEFO_DIR=$REPO TRAINER=$REPO/tests/workers/dump_trainer.py \
    MECEFO_TEST_STEP_SLEEP=0.3 DATA_PATH=mock PRECISION_ARGS="" \
    MODEL_ARGS="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64" \
    MICRO_BATCH=2 GLOBAL_BATCH=16 TRAIN_ITERS=$Q_ITERS SAVE_INTERVAL=10 \
    EXTRA_ARGS="--mecefo-rank 16 --log-interval 1 --eval-iters 0 --split 98,2,0 --lr 3e-3 \
--lr-decay-style constant"
JOB=$(submit "$OUT" "$REPO/examples/slurm/pretrain_gpt_mecefo.sbatch" 4)
say "job $JOB: pretrain_gpt_mecefo.sbatch, 4 tasks, $Q_ITERS iterations, etcd's quorum to be lost"
wait_for_text "$OUT" "elected leader on etcd" 300 || { tail -n 30 "$OUT"; fail "job $JOB never started"; }
etcd_started "$OUT"
for _ in $(seq 600); do [ -s "$CKPT/latest_checkpointed_iteration.txt" ] && break; sleep 0.5; done
[ -s "$CKPT/latest_checkpointed_iteration.txt" ] || { tail -n 30 "$OUT"; fail "job $JOB saved no checkpoint"; }
members=("$(cat "$RUN/etcd/m1.pid")" "$(cat "$RUN/etcd/m2.pid")")
grep -E "iteration +[0-9]+/" "$OUT" | tail -n 1 | cut -c1-60
kill -9 "${members[@]}"
t_kill=$(date +%s)
say "SIGKILLed etcd members m1 and m2 (pids ${members[*]}): no quorum left"
# Every supervisor ends with one line (the heartbeat timeout is 6 s: its lease TTL), and the
# script requeues the job: no hang.
wait_for_text "$OUT" "requeued, it resumes from" 90 || { tail -n 40 "$OUT"; fail "job $JOB did not stop and requeue within 90 s of etcd's quorum loss"; }
say "job $JOB stopped and requeued $(($(date +%s) - t_kill)) s after the quorum loss"
for _ in $(seq 600); do
    grep -q "Restarts=1" <<< "$(scontrol show job "$JOB" 2> /dev/null)" && break
    sleep 0.5
done
wait_job_end "$JOB" 600
say "job $JOB: $STATE"
echo "---- job output (quorum loss, requeue, resume)"
grep -E "MeCeFO job|etcd:|supervisor node [0-9]+\] .*(etcd|exiting)|loaded checkpoint|training finished" "$OUT" | cut -c1-220 || true
[ "$STATE" = COMPLETED ] || { tail -n 40 "$OUT"; fail "job $JOB ended $STATE"; }
expect_restarts "$JOB" 1 "$OUT" "job $JOB was not requeued exactly once"
first=$(sed '/(restart 1)/,$d' "$OUT")
for node in 0 1 2 3; do
    grep -Eq "^\[supervisor node $node\] .*exiting" <<< "$first" \
        || fail "node $node's supervisor did not end with its line after etcd's quorum loss"
done
grep -q "training stopped (status 1; node0=1 node1=1 node2=1 node3=1); requeued" <<< "$first" \
    || fail "the first run did not end with every node's status 1 and a requeue"
saved=$(grep -o "requeued, it resumes from $CKPT (iteration [0-9]*)" "$OUT" | grep -o "[0-9]*)$" | tr -d ')')
grep -q "loaded checkpoint from $CKPT at iteration $saved " "$OUT" || fail "the requeued run did not resume at iteration $saved"
stopped_at=$(grep -Eo "iteration +[0-9]+/" <<< "$first" | tail -n 1 | grep -Eo "[0-9]+")
"$PY" - "$RUN/metrics.jsonl" "$Q_ITERS" "$saved" "$stopped_at" << 'PYCHECK'
import json, sys
metrics, iters, saved, stopped_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
recs = [json.loads(line) for line in open(metrics) if line.strip()]
train = [r["iteration"] for r in recs if r["type"] == "train"]
# The first run stopped before the end (at or after the checkpoint); the resumed run redid
# the iterations after the checkpoint. Those up to the checkpoint are logged once; one after
# it may be logged twice (the lost run's record, then the redo's: checkpoint-restart redoes
# them); every iteration is logged, none skipped.
assert saved <= stopped_at < iters, (saved, stopped_at)
assert sorted(set(train)) == list(range(1, iters + 1)), f"iterations logged: {train}"
twice = sorted(i for i in set(train) if train.count(i) > 1)
assert all(saved < i <= stopped_at + 1 for i in twice), (twice, saved, stopped_at)
assert all(train.count(i) <= 2 for i in twice), f"iterations logged: {train}"
print(f"[test-slurm] etcd quorum lost at iteration {stopped_at}; requeued; resumed from the "
      f"checkpoint at iteration {saved}; iterations 1..{iters} logged, {twice or 'none'} twice")
PYCHECK
say "etcd's quorum lost: PASSED (every node ended with its line, requeued, resumed, finished)"
fi
say "make test-slurm: PASSED in $(($(date +%s) - T0)) s"
