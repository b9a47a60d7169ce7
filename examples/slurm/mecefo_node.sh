#!/bin/bash
# One srun task = one node's MeCeFO recovery supervisor, which starts that node's training ranks.
#
# Started by the sbatch scripts in this folder (srun runs one copy per node) and by
# rejoin_node.sh (one copy for a node that comes back). Everything else comes from the
# environment the sbatch script exports:
#   MECEFO_NNODES          supervisors (= nodes) of the job
#   MECEFO_GPUS_PER_NODE   ranks each supervisor starts
#   MECEFO_STORE           HOST:PORT of node 0's membership store (node 0 serves it)
#   MECEFO_STORE_MODE      single (node 0 serves the store; its loss ends the job) | etcd
#                          (every node campaigns on the etcd cluster of MECEFO_ETCD_ENDPOINTS;
#                          the leader serves the store and coordinates; any node can be lost)
#   MECEFO_ETCD_ENDPOINTS  etcd mode: HOST:PORT,... of every etcd member
#   MECEFO_RUN_DIR         where node<K>.exit, supervisor.node<K>.pid and, after a SIGTERM
#                          that ended in a save, node<K>.stopped are written
#                          (node<K>.rejoin.exit, supervisor.node<K>.rejoin.pid for a rejoin)
#   MECEFO_NODE_RANK       optional; default $SLURM_PROCID (rejoin_node.sh sets it)
#   MECEFO_REJOIN          optional; 1 = this node replaces a lost one (supervisor --rejoin)
#   PYTHON                 the interpreter with megatron_mecefo installed
# Arguments: supervisor flags, then -- and the trainer command.
set -uo pipefail

node=${MECEFO_NODE_RANK:-${SLURM_PROCID:?mecefo_node.sh runs under srun (no SLURM_PROCID)}}
store_host=${MECEFO_STORE%:*}
store_port=${MECEFO_STORE##*:}
args=(
    --nproc-per-node "$MECEFO_GPUS_PER_NODE" --nnodes "$MECEFO_NNODES" --node-rank "$node"
    --pid-file "$MECEFO_RUN_DIR/pids.node$node"
)
mode=${MECEFO_STORE_MODE:-single}
# This node's address, should it serve a store (its Slurm node name, as HOSTS in the sbatch).
me=${SLURMD_NODENAME:-$(hostname)}
case $mode in
    single)
        store=$MECEFO_STORE
        if [ "${MECEFO_REJOIN:-0}" = 1 ]; then
            args+=(--store "$store" --rejoin)
        elif [ "$node" -eq 0 ]; then
            args+=(--store-host "$store_host" --store-port "$store_port")
        else
            args+=(--store "$store")
        fi
        ;;
    etcd)
        # No --store: the leader's address comes from etcd. Every node can lead (node 0 first,
        # on the sbatch script's STORE_PORT), so each serves on its own address.
        store="etcd ${MECEFO_ETCD_ENDPOINTS:?MECEFO_STORE_MODE=etcd needs MECEFO_ETCD_ENDPOINTS}"
        args+=(--etcd "$MECEFO_ETCD_ENDPOINTS")
        if [ "${MECEFO_REJOIN:-0}" = 1 ]; then
            args+=(--rejoin --store-host "$me")
        elif [ "$node" -eq 0 ]; then
            args+=(--store-host "$store_host" --store-port "$store_port")
        else
            args+=(--store-host "$me")
        fi
        ;;
    *)
        echo "[mecefo_node] error: MECEFO_STORE_MODE=$mode: single or etcd (replicated was" \
            "removed: set MECEFO_ETCD_ENDPOINTS, or run on three nodes or more; docs/cluster.md)" >&2
        exit 2
        ;;
esac
args+=(--store-mode "$mode")

echo "[mecefo_node] $(hostname): node $node of $MECEFO_NNODES, $MECEFO_GPUS_PER_NODE ranks," \
    "store $store${MECEFO_REJOIN:+ (rejoin)}"
# In the background so that its PID can be recorded (a test kills it to stand in for a lost
# node: its ranks die with it, PR_SET_PDEATHSIG).
tag=node$node
if [ "${MECEFO_REJOIN:-0}" = 1 ]; then
    tag=node$node.rejoin
fi
"${PYTHON:-python}" -m megatron_mecefo.recovery.supervisor "${args[@]}" "$@" &
pid=$!
echo "$pid" > "$MECEFO_RUN_DIR/supervisor.$tag.pid"
# Slurm's --signal (or scancel) SIGTERMs the processes of this step, the supervisor (in this
# shell's process group) included, which stops or saves (--exit-signal-handler). This shell
# only keeps waiting: without a trap it would die at once, and the step with it. Not passed on:
# a second SIGTERM would make the supervisor kill its ranks at once. (A wait interrupted by a
# trapped signal returns > 128 at once.)
signalled=0
trap 'signalled=1' TERM
wait "$pid"
rc=$?
while [ "$rc" -gt 128 ] && kill -0 "$pid" 2>/dev/null; do
    wait "$pid"
    rc=$?
done
echo "$rc" > "$MECEFO_RUN_DIR/$tag.exit"
if [ "$signalled" = 1 ] && [ "$rc" -eq 0 ]; then
    # Stopped by the signal and saved (the supervisor exits 0 only then): the sbatch script
    # requeues the job, which resumes from that checkpoint.
    echo TERM > "$MECEFO_RUN_DIR/$tag.stopped"
fi
echo "[mecefo_node] $(hostname): node $node supervisor exited with status $rc"
exit "$rc"
