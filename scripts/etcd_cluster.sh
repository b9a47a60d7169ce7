#!/usr/bin/env bash
# A 3-member etcd cluster on 127.0.0.1, for the tests and the benchmarks of the etcd control
# plane (megatron_mecefo/recovery/etcd_control.py).
#
#   scripts/etcd_cluster.sh start DIR [BASE_PORT]   # members 0..2, wait until all are healthy
#   scripts/etcd_cluster.sh stop DIR                # SIGTERM each member by its PID, SIGKILL after 3 s
#
# Member i listens for clients on BASE_PORT + 2i and for its peers on BASE_PORT + 2i + 1
# (BASE_PORT defaults to 23790). Everything lives in DIR: member i's data in DIR/member<i>,
# its PID in DIR/member<i>.pid, its log in DIR/member<i>.log, and the client endpoints
# (HOST:PORT,...) in DIR/endpoints, which start also prints. The members are started with
# setsid, so they outlive the shell that started them and a test can SIGKILL/SIGSTOP one by PID.
#
# Environment: ETCD (the binary, default etcd on PATH), ETCDCTL (default etcdctl, used for
# the readiness check when present), ETCD_READY_TIMEOUT (seconds, default 60),
# ETCD_HEARTBEAT_MS / ETCD_ELECTION_MS (raft timing, defaults 100 / 1000: etcd's own),
# ETCD_CLIENT_HOST (the address the members serve clients on, default 127.0.0.1; e.g. a
# bridge's address that other network namespaces reach; the peers stay on 127.0.0.1).
set -euo pipefail

MEMBERS=3
ETCD=${ETCD:-etcd}
ETCDCTL=${ETCDCTL:-etcdctl}
READY_TIMEOUT=${ETCD_READY_TIMEOUT:-60}
HEARTBEAT_MS=${ETCD_HEARTBEAT_MS:-100}
ELECTION_MS=${ETCD_ELECTION_MS:-1000}
CLIENT_HOST=${ETCD_CLIENT_HOST:-127.0.0.1}

usage() {
    echo "usage: $0 start DIR [BASE_PORT] | stop DIR" >&2
    exit 2
}

fail() {
    echo "etcd_cluster.sh: $*" >&2
    exit 1
}

alive() { [ -n "$1" ] && kill -0 "$1" 2> /dev/null; }

pid_of() {
    local f="$1/member$2.pid"
    if [ -f "$f" ]; then cat "$f"; fi
}

# stop DIR: every member whose PID file names a live process; SIGKILL after 3 s (a leader that
# is told to stop tries to hand its leadership over for up to 7 s; the data is thrown away).
stop_cluster() {
    local dir="$1" i pid deadline
    for i in $(seq 0 $((MEMBERS - 1))); do
        pid=$(pid_of "$dir" "$i")
        if alive "$pid"; then
            kill -CONT "$pid" 2> /dev/null || true # a SIGSTOPped member cannot act on SIGTERM
            kill -TERM "$pid" 2> /dev/null || true
        fi
    done
    deadline=$((SECONDS + 3))
    for i in $(seq 0 $((MEMBERS - 1))); do
        pid=$(pid_of "$dir" "$i")
        while alive "$pid" && [ "$SECONDS" -lt "$deadline" ]; do
            sleep 0.1
        done
        if alive "$pid"; then
            kill -KILL "$pid" 2> /dev/null || true
        fi
        rm -f "$dir/member$i.pid"
    done
}

# healthy ENDPOINT: a linearizable read answered (the member is in a cluster with a leader).
healthy() {
    if command -v "$ETCDCTL" > /dev/null 2>&1; then
        ETCDCTL_API=3 "$ETCDCTL" --endpoints="$1" --command-timeout=2s endpoint health \
            > /dev/null 2>&1
    else
        # The JSON gateway's /health answers {"health":"true"} only once the member has a leader.
        curl -fsS --max-time 2 "http://$1/health" 2> /dev/null | grep -q '"health":"true"'
    fi
}

start_cluster() {
    local dir="$1" base="$2" i cluster="" endpoints="" pid deadline all
    command -v "$ETCD" > /dev/null 2>&1 || fail "no '$ETCD' binary (Debian: apt-get install etcd-server; or make etcd)"
    [[ "$base" =~ ^[0-9]+$ ]] || fail "BASE_PORT must be a number, not '$base'"
    mkdir -p "$dir"
    for i in $(seq 0 $((MEMBERS - 1))); do
        pid=$(pid_of "$dir" "$i")
        alive "$pid" && fail "member $i already runs (PID $pid, $dir/member$i.pid); stop it first"
        cluster+="${cluster:+,}m$i=http://127.0.0.1:$((base + 2 * i + 1))"
        endpoints+="${endpoints:+,}$CLIENT_HOST:$((base + 2 * i))"
    done
    for i in $(seq 0 $((MEMBERS - 1))); do
        local client="http://$CLIENT_HOST:$((base + 2 * i))" peer="http://127.0.0.1:$((base + 2 * i + 1))"
        rm -rf "$dir/member$i"
        setsid "$ETCD" --name "m$i" --data-dir "$dir/member$i" \
            --listen-client-urls "$client" --advertise-client-urls "$client" \
            --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
            --initial-cluster "$cluster" --initial-cluster-token "mecefo-$base" \
            --initial-cluster-state new \
            --heartbeat-interval "$HEARTBEAT_MS" --election-timeout "$ELECTION_MS" \
            --logger zap --log-outputs stderr \
            < /dev/null > "$dir/member$i.log" 2>&1 &
        echo $! > "$dir/member$i.pid"
    done
    echo "$endpoints" > "$dir/endpoints"
    deadline=$((SECONDS + READY_TIMEOUT))
    while true; do
        all=1
        for i in $(seq 0 $((MEMBERS - 1))); do
            pid=$(pid_of "$dir" "$i")
            if ! alive "$pid"; then
                stop_cluster "$dir"
                fail "member $i (PID $pid) exited during start-up; its log: $dir/member$i.log"
            fi
            healthy "$CLIENT_HOST:$((base + 2 * i))" || all=0
        done
        [ "$all" -eq 1 ] && break
        if [ "$SECONDS" -ge "$deadline" ]; then
            stop_cluster "$dir"
            fail "not healthy within ${READY_TIMEOUT} s; logs: $dir/member*.log"
        fi
        sleep 0.2
    done
    echo "$endpoints"
}

[ "$#" -ge 2 ] || usage
case "$1" in
    start)
        [ "$#" -le 3 ] || usage
        start_cluster "$2" "${3:-23790}"
        ;;
    stop)
        [ "$#" -eq 2 ] || usage
        stop_cluster "$2"
        ;;
    *) usage ;;
esac
