#!/bin/bash
# Bring a lost node back into a running MeCeFO job (started by one of the sbatch scripts here).
#
#   examples/slurm/rejoin_node.sh [--host HOST] [--standby N] RUN_DIR NODE_RANK
#
# RUN_DIR is the job's run folder (it holds launch.env, written by the sbatch script);
# NODE_RANK is the lost node's rank (its supervisor's "node K" in the log): any node, node 0
# included, in etcd mode (three nodes or more, or MECEFO_ETCD_ENDPOINTS set); 1 or more with
# node 0's single store. --host: the node to run on, a spare node of the allocation
# (SPARE_NODES) or the repaired node once it is back in the job; default: the first spare
# node, else the node Slurm picks. It starts a new job step (srun --jobid --overlap) that
# runs the node's supervisor with --rejoin: the supervisor waits until the coordinator has
# declared the old ranks dead, starts them as their next incarnation, and they join at an
# iteration boundary a few steps ahead, where they are healed from a data-parallel peer (no
# checkpoint read).
# --standby N: N warm processes import everything while the node waits, so it can be started
# ahead of a failure (a hot spare) and takes over about a second after the death is known.
# Run it by hand, from a cron/watchdog, or from the batch script itself.
set -euo pipefail

host=
extra=()
while [ $# -gt 0 ]; do
    case $1 in
        --host) host=$2; shift 2 ;;
        --standby) extra+=(--standby "$2"); shift 2 ;;
        *) break ;;
    esac
done
if [ $# -ne 2 ] || [ ! -f "$1/launch.env" ]; then
    echo "usage: $0 [--host HOST] [--standby N] RUN_DIR NODE_RANK  (RUN_DIR: the folder with" \
        "the job's launch.env)" >&2
    exit 2
fi
run_dir=$1
node=$2
# shellcheck source=/dev/null
source "$run_dir/launch.env"
if [ -z "$host" ] && [ "${#HOSTS[@]}" -gt "$NODES" ]; then
    host=${HOSTS[$NODES]}
fi
first=0
if [ "${MECEFO_STORE_MODE:-single}" != etcd ]; then
    first=1  # node 0 hosts the only store: its loss ended the job
fi
if ! [ "$node" -ge "$first" ] 2>/dev/null || [ "$node" -ge "$MECEFO_NNODES" ]; then
    echo "error: NODE_RANK=$node: a lost node's rank is $first..$((MECEFO_NNODES - 1)) (node 0" \
        "hosts the only membership store on fewer than three nodes without" \
        "MECEFO_ETCD_ENDPOINTS, and cannot be replaced while the job runs)" >&2
    exit 2
fi
export MECEFO_NODE_RANK=$node MECEFO_REJOIN=1
echo "rejoin_node.sh: job $JOB_ID, node $node on ${host:-a node Slurm picks}"
host_args=()
if [ -n "$host" ]; then
    host_args=(--nodelist "$host")
fi
exec srun --jobid "$JOB_ID" --overlap --ntasks=1 --nodes=1 "${host_args[@]}" \
    --kill-on-bad-exit=0 --job-name="mecefo-rejoin-node$node" \
    "$MECEFO_DIR/examples/slurm/mecefo_node.sh" "${SUP_ARGS[@]}" "${extra[@]}" -- "${TRAIN_CMD[@]}"
