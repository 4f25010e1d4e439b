#!/usr/bin/env bash
# One entry point for drafter training, and for decoding at scale, on one process, several GPUs, or several
# nodes.
#
#   ./launch.sh [overrides...]                                  one process (CPU or one GPU)
#   NPROC=4 ./launch.sh trainer=deepspeed_stage_2               4 GPUs on this machine
#   VDTRAIN_RUN_NAME=exp1 NNODES=2 NODE_RANK=0 MASTER_ADDR=10.1.2.3 NPROC=8 ./launch.sh trainer=multinode
#                                                               on every node, with its own NODE_RANK
#   sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 launch.sh trainer=multinode
#                                                               under SLURM: srun starts one task per GPU
#
# VDTRAIN_APP picks what runs (default vdtrain.fit): vdtrain.evaluate, vdtrain.generate,
# data_prep.self_generate or data_prep.features decode with one process per GPU, each its part of the
# prompts (vdtrain/sharding.py), e.g.
#   VDTRAIN_APP=vdtrain.evaluate NPROC=8 ./launch.sh eval=coco30k drafter=...
#
# Under SLURM the ranks come from SLURM's variables; otherwise torchrun sets RANK/WORLD_SIZE/... and
# Lightning (or vdtrain.sharding) picks them up. Extra arguments are Hydra overrides passed to
# `python -m $VDTRAIN_APP`.
#
# All ranks and nodes write one run folder, checkpoints/runs/<name> (unless hydra.run.dir is given):
# <name> is VDTRAIN_RUN_NAME; on one node it defaults to the start time taken here, under SLURM to
# slurm-<job>.<step> (the same after a requeue, so resume=last finds the checkpoint); for several nodes
# without SLURM set VDTRAIN_RUN_NAME to one name on every node (vdtrain.fit refuses to guess).
set -euo pipefail
NPROC=${NPROC:-1}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
given_master=${MASTER_ADDR:-}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-python}
APP=${VDTRAIN_APP:-vdtrain.fit}
layout=()  # how many nodes and processes, for Lightning's trainer (the decoding apps read the launcher's variables)

if [[ -n "${SLURM_JOB_ID:-}" && -z "${SLURM_STEP_ID:-}" ]]; then
    nodes=${SLURM_JOB_NUM_NODES:-1}
    tasks=${SLURM_NTASKS_PER_NODE:-1}
    if [[ "$APP" == vdtrain.fit ]]; then
        layout=(trainer.num_nodes="$nodes" trainer.devices="$tasks")
    else  # torch.distributed outside Lightning: the tasks meet at the first node
        MASTER_ADDR=${given_master:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
        export MASTER_ADDR MASTER_PORT
    fi
    exec srun "$PYTHON" -m "$APP" ${layout[@]+"${layout[@]}"} "$@"
fi
if [[ -n "${SLURM_STEP_ID:-}" ]]; then  # already inside srun
    exec "$PYTHON" -m "$APP" "$@"
fi
if (( NPROC == 1 && NNODES == 1 )); then
    exec "$PYTHON" -m "$APP" "$@"
fi
if (( NNODES == 1 )); then
    export VDTRAIN_RUN_NAME=${VDTRAIN_RUN_NAME:-$(date +%Y-%m-%d_%H-%M-%S)}
fi
if [[ "$APP" == vdtrain.fit ]]; then
    layout=(trainer.num_nodes="$NNODES" trainer.devices="$NPROC")
fi
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m "$APP" ${layout[@]+"${layout[@]}"} "$@"
