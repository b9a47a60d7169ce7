# shellcheck shell=bash disable=SC2034,SC2153,SC2154
# Sourced (not run) by the sbatch scripts of this folder: which membership store the
# supervisors use, the job's own etcd members, and the job's result. docs/cluster.md.
#
# Reads the sbatch script's variables: NNODES, NODES, HOSTS, STORE_HOST, STORE_PORT, RUN_DIR,
# PYTHON, MECEFO_DIR, and these (each can be set in sbatch's environment):
#   MECEFO_ETCD_ENDPOINTS   HOST:PORT,... of an etcd cluster (service nodes): --store-mode etcd
#   STORE_MODE              unset (default): etcd when MECEFO_ETCD_ENDPOINTS is set or the job
#                           has three nodes or more, else node 0's single store; single: node
#                           0's store whatever the size; etcd: fail unless etcd can be had
#   MECEFO_ETCD_CLIENT_PORT, MECEFO_ETCD_PEER_PORT   the job's own members' ports (defaults:
#                           STORE_PORT + 1 and + 4; members that share a host, only in a
#                           job of fewer than three hosts, take the next ports)
#   MECEFO_ETCD_DATA_DIR    node-local parent of the members' data dirs (default /tmp)
#   ETCD                    the etcd binary on the nodes (default: etcd on PATH)
#   MECEFO_ETCD_READY_TIMEOUT  seconds for the job's own members to become healthy (default 60)
# (shellcheck: the variables read are the sbatch script's, those set are for it.)

MECEFO_ETCD_STEPS=()  # the PIDs of the job's own etcd members' srun steps

# mecefo_choose_store: sets and exports MECEFO_STORE_MODE (single | etcd) and, for etcd,
# MECEFO_ETCD_ENDPOINTS; MECEFO_JOB_ETCD=1 when the job must start its own members
# (mecefo_start_etcd). One line and status 2 on a setting that cannot work.
mecefo_choose_store() {
    MECEFO_JOB_ETCD=0
    case ${STORE_MODE:-} in
        replicated)
            echo "error: STORE_MODE=replicated: the primary/standby store was removed. Unset" \
                "STORE_MODE; set MECEFO_ETCD_ENDPOINTS=HOST:PORT,... for an etcd cluster on" \
                "service nodes, or leave it unset on three nodes or more (the job then starts" \
                "etcd on its first three nodes); docs/cluster.md"
            return 2
            ;;
        "" | single | etcd) ;;
        *)
            echo "error: STORE_MODE=$STORE_MODE: use single or etcd, or leave it unset" \
                "(etcd from three nodes on or with MECEFO_ETCD_ENDPOINTS); docs/cluster.md"
            return 2
            ;;
    esac
    if [ "${STORE_MODE:-}" = single ]; then
        MECEFO_STORE_MODE=single
    elif [ -n "${MECEFO_ETCD_ENDPOINTS:-}" ]; then
        MECEFO_STORE_MODE=etcd
    elif [ "$NNODES" -ge 3 ]; then
        MECEFO_STORE_MODE=etcd
        MECEFO_JOB_ETCD=1
    elif [ "${STORE_MODE:-}" = etcd ]; then
        echo "error: STORE_MODE=etcd on $NNODES nodes: the job starts its own etcd only on" \
            "three nodes or more; set MECEFO_ETCD_ENDPOINTS=HOST:PORT,... (an etcd cluster on" \
            "service nodes), or unset STORE_MODE for node 0's single store"
        return 2
    else
        MECEFO_STORE_MODE=single
        echo "note: $NNODES node(s) and no MECEFO_ETCD_ENDPOINTS: node 0 ($STORE_HOST) hosts the" \
            "only membership store, a single point of failure (its loss ends the job, which is" \
            "requeued from the last checkpoint); to survive it, set" \
            "MECEFO_ETCD_ENDPOINTS=HOST:PORT,... of an etcd cluster (docs/cluster.md)"
    fi
    export MECEFO_STORE_MODE MECEFO_ETCD_ENDPOINTS=${MECEFO_ETCD_ENDPOINTS:-}
}

# mecefo_start_etcd: one etcd member on each of the job's first three nodes (an srun step
# each, etcd_member.sh), data node-local; waits until all three answer healthy and sets
# MECEFO_ETCD_ENDPOINTS. One line and status 2 when they do not come up.
mecefo_start_etcd() {
    local client=${MECEFO_ETCD_CLIENT_PORT:-$((STORE_PORT + 1))}
    local peer=${MECEFO_ETCD_PEER_PORT:-$((STORE_PORT + 4))}
    local data=${MECEFO_ETCD_DATA_DIR:-/tmp}/mecefo-etcd-$SLURM_JOB_ID
    local token=mecefo-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}
    local i hosts=() cports=() pports=() cluster="" endpoints=""
    MECEFO_ETCD_STATE=$RUN_DIR/etcd
    rm -rf "$MECEFO_ETCD_STATE"
    mkdir -p "$MECEFO_ETCD_STATE"
    for i in 0 1 2; do
        # Member i on node i; only a job of fewer than three hosts (a test that emulates nodes
        # as tasks of one host) puts two on one host, on the next ports.
        hosts[i]=${HOSTS[i % NODES]}
        cports[i]=$((client + i / NODES))
        pports[i]=$((peer + i / NODES))
        cluster+="${cluster:+,}m$i=http://${hosts[i]}:${pports[i]}"
        endpoints+="${endpoints:+,}${hosts[i]}:${cports[i]}"
    done
    MECEFO_ETCD_STEPS=()
    for i in 0 1 2; do
        srun --overlap --kill-on-bad-exit=0 --no-kill --ntasks=1 --nodes=1 \
            --nodelist="${hosts[i]}" --job-name="mecefo-etcd-m$i" \
            "$MECEFO_DIR/examples/slurm/etcd_member.sh" "m$i" "${hosts[i]}" "${cports[i]}" \
            "${pports[i]}" "$cluster" "$token" "$data-m$i" "$MECEFO_ETCD_STATE" &
        MECEFO_ETCD_STEPS+=($!)
    done
    local deadline=$((SECONDS + ${MECEFO_ETCD_READY_TIMEOUT:-60}))
    # /health answers {"health":"true"} once the member is in a cluster with a leader.
    until "$PYTHON" - "$endpoints" << 'HEALTH' 2> /dev/null; do
import json, sys, urllib.request
direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no http_proxy
for e in sys.argv[1].split(","):
    with direct.open(f"http://{e}/health", timeout=2) as r:
        assert json.load(r)["health"] == "true"
HEALTH
        for i in 0 1 2; do
            if ! kill -0 "${MECEFO_ETCD_STEPS[i]}" 2> /dev/null; then
                echo "error: the job's etcd member m$i on ${hosts[i]} exited at start-up (srun's" \
                    "error above, or its log $MECEFO_ETCD_STATE/m$i.log); set" \
                    "MECEFO_ETCD_ENDPOINTS to use an etcd cluster on service nodes instead"
                mecefo_stop_etcd
                return 2
            fi
        done
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "error: the job's etcd members ($endpoints) were not healthy within" \
                "${MECEFO_ETCD_READY_TIMEOUT:-60} s (logs: $MECEFO_ETCD_STATE/m*.log); ports" \
                "taken? set MECEFO_ETCD_CLIENT_PORT / MECEFO_ETCD_PEER_PORT"
            mecefo_stop_etcd
            return 2
        fi
        sleep 0.5
    done
    export MECEFO_ETCD_ENDPOINTS=$endpoints
    echo "etcd: the job's own 3 members on ${hosts[*]} (clients $endpoints), data in" \
        "$data-m<i>; it keeps its quorum while 2 of them live"
}

# mecefo_stop_etcd: SIGTERM to each member's step (scancel --signal: etcd stops cleanly and
# the member removes its data dir; a SIGTERM to srun would SIGKILL the step), then wait up to
# 10 s for the steps to end.
mecefo_stop_etcd() {
    local id name pid alive deadline=$((SECONDS + 10))
    [ "${#MECEFO_ETCD_STEPS[@]}" -gt 0 ] || return 0
    while read -r id name; do
        case $name in mecefo-etcd-*) scancel --signal=TERM "$id" ;; esac
    done < <(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j")
    while true; do
        alive=0
        for pid in "${MECEFO_ETCD_STEPS[@]}"; do
            kill -0 "$pid" 2> /dev/null && alive=1
        done
        if [ "$alive" = 0 ] || [ "$SECONDS" -ge "$deadline" ]; then
            break
        fi
        sleep 0.2
    done
    MECEFO_ETCD_STEPS=()
}

# mecefo_run_step CMD...: runs the training step (its srun) and waits for it, then for the
# rejoin steps (rejoin_node.sh), at most 45 s (a leader waits at most 30 s for the others).
# The time limit's SIGTERM (#SBATCH --signal=B:TERM@120) reaches only this batch shell, which
# passes it on to every training step, this one and the rejoin steps, and not to the job's
# etcd members: those must keep serving while the ranks save. Returns the training step's
# status.
mecefo_run_step() {
    local rc deadline
    "$@" &
    MECEFO_STEP_PID=$!
    trap mecefo_pass_term TERM
    while true; do
        wait "$MECEFO_STEP_PID"
        rc=$?
        # A wait interrupted by the trapped signal returns > 128 at once: wait again.
        if [ "$rc" -le 128 ] || ! kill -0 "$MECEFO_STEP_PID" 2> /dev/null; then
            break
        fi
    done
    # A rejoined node's supervisor may lead the job (it won a term after the leader's loss):
    # it hosts the store until every other node has finished, and resigns on etcd after
    # them. The batch's end would cancel its step (and fail it) in that window, and stopping
    # etcd under it would stall its resignation. It ends within a second of the others.
    deadline=$((SECONDS + 45))
    while [ "$SECONDS" -lt "$deadline" ] && mecefo_rejoin_steps_running; do
        sleep 0.2
    done
    trap - TERM
    return "$rc"
}

mecefo_rejoin_steps_running() {  # true while a step of rejoin_node.sh runs in this job
    local id name
    while read -r id name; do
        case $name in mecefo-rejoin-*) return 0 ;; esac
    done < <(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" 2> /dev/null)
    return 1
}

mecefo_pass_term() {
    local id name
    echo "SIGTERM before the time limit: passed on to the training steps"
    while read -r id name; do
        case $name in mecefo-etcd-*) continue ;; esac
        if [[ $id =~ ^[0-9]+\.[0-9]+$ ]]; then  # not the batch or extern step
            scancel --signal=TERM "$id"
        fi
    done < <(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j")
}

# mecefo_job_result: the job's outcome from the supervisors' exit files (mecefo_node.sh):
# JOB_RC=0 when any node, a rejoined one included, ended 0 (training finished, or stopped by
# the time-limit signal after its save: JOB_STOPPED=1 then); else the first node's non-zero
# status. Any node's exit while the others train does not decide it (etcd mode: node 0's
# neither). JOB_STATUSES lists every node's status.
mecefo_job_result() {
    local f s
    JOB_RC=
    JOB_STOPPED=0
    JOB_STATUSES=
    for f in "$RUN_DIR"/node*.exit; do
        [ -f "$f" ] || continue
        s=$(cat "$f")
        JOB_STATUSES+="${JOB_STATUSES:+ }$(basename "$f" .exit)=$s"
        if [ "$s" = 0 ]; then
            JOB_RC=0
        elif [ -z "$JOB_RC" ]; then
            JOB_RC=$s
        fi
    done
    JOB_RC=${JOB_RC:-1}
    if [ "$JOB_RC" -eq 0 ] && compgen -G "$RUN_DIR/node*.stopped" > /dev/null; then
        JOB_STOPPED=1
    fi
}
