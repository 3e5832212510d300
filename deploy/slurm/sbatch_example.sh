#!/bin/bash
# h5serve inside a SLURM job, without admin help: the daemons run as a job step.
#
#   sbatch deploy/slurm/sbatch_example.sh            (DATA=/path/train.h5 sbatch ... to override)
#
# Use this when there is no h5serve prolog on the cluster, or when the cluster gives each
# job a private /dev/shm (job_container/tmpfs): a daemon started inside the job shares the
# job's /dev/shm with the training processes, a daemon started outside it would not.
# The price: the daemons live and die with the job, so nothing stays cached between jobs.
#
# Steps:
#   1. one daemon per node, as a background step (srun --overlap, see below);
#   2. wait until every node's daemon answers `h5serve status`;
#   3. `h5serve preload --plan`: each node loads the shards of the ranks it will run, all
#      nodes in parallel, before training starts (optional: without it each rank's first
#      access loads its shard);
#   4. train (srun python train.py, or srun torchrun ...);
#   5. stop the daemons (segments unlinked), also when training fails.
#
# The #SBATCH resources below (4 GPUs and 8 CPUs per task) are an example for a GPU node:
# options on the command line override them, e.g. on a small CPU cluster
#   sbatch --gpus-per-node=0 --cpus-per-task=1 --ntasks-per-node=2 sbatch_example.sh
#
#SBATCH --job-name=h5serve-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out

set -u

DATA=${DATA:-/datasets/imagenet/train.h5}   # same path on every node (shared filesystem)
X_KEY=${X_KEY:-images}
Y_KEY=${Y_KEY:-labels}
MAX_MEMORY=${MAX_MEMORY:-64G}               # per node; must fit in /dev/shm next to the job

# One runtime dir per job and node. It must be on a node-local filesystem (/tmp, /dev/shm,
# /run/user/...), never on NFS/Lustre/GPFS: the daemon's pidfile lock and socket are per
# node. Exported, so every srun step below, and every rank, resolves the same dir.
export H5SERVE_RUNTIME_DIR=/tmp/h5serve-$SLURM_JOB_ID

# The training layout, captured here in the batch script: inside a one-task-per-node
# helper step, SLURM_TASKS_PER_NODE/SLURM_NTASKS describe that step, not the training job.
NODES=$SLURM_JOB_NUM_NODES
WORLD_SIZE=$SLURM_NTASKS
TASKS_PER_NODE=$SLURM_TASKS_PER_NODE        # e.g. 4(x2); uneven layouts like 3(x2),2 work too

# A step with one task on every node. --overlap lets it share CPUs, memory and GPUs with the
# other steps (otherwise the long-running daemon step would hold resources the training
# step waits for, forever). -N/-n are explicit because srun would otherwise inherit
# SLURM_NTASKS (the training task count) from the batch environment.
per_node() {
    srun --nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 --overlap --kill-on-bad-exit=0 "$@"
}

# 1. The daemons. --foreground: a daemonizing `h5serve start` would return, the step would
#    end, and slurmstepd kills whatever a finished step leaves behind.
per_node h5serve start --foreground --runtime-dir "$H5SERVE_RUNTIME_DIR" --max-memory "$MAX_MEMORY" \
    --log-level INFO &
DAEMON_STEP=$!

# shellcheck disable=SC2317  # called from the EXIT trap
stop_daemons() {
    # SIGTERM semantics: every segment unlinked. Then remove the runtime dirs.
    per_node h5serve stop --runtime-dir "$H5SERVE_RUNTIME_DIR" >/dev/null 2>&1
    wait "$DAEMON_STEP" 2>/dev/null
    per_node rm -rf "$H5SERVE_RUNTIME_DIR" >/dev/null 2>&1
}
trap stop_daemons EXIT

# 2. Wait until every node's daemon answers (`status` exits 0 when it runs, 3 when not).
USE_H5SERVE=yes
deadline=$((SECONDS + 120))
until per_node h5serve status --runtime-dir "$H5SERVE_RUNTIME_DIR" >/dev/null 2>&1; do
    if ! kill -0 "$DAEMON_STEP" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
        echo "h5serve daemons did not come up; training reads lazily through h5py" >&2
        USE_H5SERVE=no
        break
    fi
    sleep 2
done

# 3. Preload this node's ranks on every node, in parallel. --plan takes the node's index
#    from SLURM_NODEID and the layout from the flags (see `h5serve plan --help`). A failure
#    here is not fatal: ranks load their shards on first access.
if [ "$USE_H5SERVE" = yes ]; then
    per_node h5serve plan --world-size "$WORLD_SIZE" --tasks-per-node "$TASKS_PER_NODE"
    per_node h5serve preload "$DATA" --x-key "$X_KEY" --y-key "$Y_KEY" --mode contiguous \
        --plan --world-size "$WORLD_SIZE" --tasks-per-node "$TASKS_PER_NODE" \
        || echo "preload failed; ranks will load their shards on first access" >&2
fi

# 4. Train: one task per rank. MASTER_ADDR/PORT for torch.distributed's env:// init.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-29500}
# The single quotes matter: SLURM_PROCID etc. are expanded by each task, not here.
# shellcheck disable=SC2016
srun --kill-on-bad-exit=1 bash -c \
    'RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS exec python train.py'
status=$?

# Or torchrun, one launcher per node starting 4 ranks each. Static rendezvous keeps node
# N's ranks at N*4 .. N*4+3, which is what the preload above assumed (with c10d rendezvous
# the node order is arbitrary: still correct, but preloads may land on the wrong node).
# srun --nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 bash -c \
#     'exec torchrun --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node=4 --node_rank="$SLURM_NODEID" \
#          --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" train.py'

# 5. The EXIT trap stops the daemons.
exit "$status"
