#!/bin/bash
# One member of the job's own 3-member etcd cluster: one srun step per member, on the job's
# first three nodes, started by the sbatch scripts here (mecefo_store.sh) when
# MECEFO_ETCD_ENDPOINTS is not set and the job has three nodes or more.
#
#   etcd_member.sh NAME HOST CLIENT_PORT PEER_PORT INITIAL_CLUSTER TOKEN DATA_DIR STATE_DIR
#
# HOST: the address the other nodes reach this one at (its Slurm node name); etcd listens on
# MECEFO_ETCD_LISTEN_IP (default 0.0.0.0: etcd binds IPs, not names). DATA_DIR is node-local
# (etcd fsyncs its log on every write; a shared file system would slow every commit) and is
# removed when the member stops: the state is the job's control state only, and a requeued
# job starts a fresh cluster. STATE_DIR (in the run dir) gets NAME.pid (etcd's PID) and
# NAME.log. SIGTERM (the sbatch script at the end of the job, or Slurm) stops etcd.
set -uo pipefail

if [ $# -ne 8 ]; then
    echo "usage: $0 NAME HOST CLIENT_PORT PEER_PORT INITIAL_CLUSTER TOKEN DATA_DIR STATE_DIR" >&2
    exit 2
fi
name=$1 host=$2 client_port=$3 peer_port=$4 cluster=$5 token=$6 data=$7 state=$8
listen=${MECEFO_ETCD_LISTEN_IP:-0.0.0.0}
etcd=${ETCD:-etcd}
if ! command -v "$etcd" > /dev/null 2>&1; then
    echo "[etcd_member] $(hostname): error: no '$etcd' binary on this node; install etcd 3.4+" \
        "(Debian/Ubuntu: apt-get install etcd-server), set ETCD to its path, or give the job" \
        "an etcd cluster with MECEFO_ETCD_ENDPOINTS=HOST:PORT,..." >&2
    exit 2
fi
rm -rf "$data"
mkdir -p "$(dirname "$data")" "$state"
"$etcd" --name "$name" --data-dir "$data" \
    --listen-client-urls "http://$listen:$client_port" \
    --advertise-client-urls "http://$host:$client_port" \
    --listen-peer-urls "http://$listen:$peer_port" \
    --initial-advertise-peer-urls "http://$host:$peer_port" \
    --initial-cluster "$cluster" --initial-cluster-token "$token" --initial-cluster-state new \
    --logger zap --log-outputs stderr < /dev/null > "$state/$name.log" 2>&1 &
pid=$!
echo "$pid" > "$state/$name.pid"
# Passed on, not acted on here: etcd stops cleanly on SIGTERM. (A wait interrupted by a
# trapped signal returns > 128 at once: wait again until etcd has exited.)
trap 'kill -TERM "$pid" 2> /dev/null' TERM INT
wait "$pid"
rc=$?
while kill -0 "$pid" 2> /dev/null; do
    wait "$pid"
    rc=$?
done
rm -rf "$data"
echo "[etcd_member] $(hostname): etcd member $name ($host:$client_port) exited with status $rc"
