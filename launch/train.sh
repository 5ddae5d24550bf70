#!/usr/bin/env bash
# RollPacker on Slurm: one rollpacker-train (torchrun's agent) per node, c10d rendezvous on the first node.
#
#   sbatch --nodes=2 --gpus-per-node=8 launch/train.sh configs/qwen2.5-7b.yaml [key=value ...]
#   sbatch --wait launch/train.sh configs/tiny-cpu.yaml run.steps=4         # CPU nodes
#
# Environment knobs: NPROC_PER_NODE (default: the node's GPUs, or 2 without GPUs),
# MASTER_PORT (default derived from the job id), MAX_RESTARTS (default 3: a crashed
# rank restarts the job's workers, which resume from the latest checkpoint).
#SBATCH --job-name=rollpacker
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=slurm-%j.out
set -euo pipefail

config=${1:?usage: sbatch launch/train.sh CONFIG.yaml [section.key=value ...]}
shift
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"

mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${nodes[0]}
# Reached at its NodeAddr, which Slurm sets to the node name unless slurm.conf gives an address
head_addr=$(scontrol show node "$head_node" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
head_addr=${head_addr:-$head_node}
# 20000-28999: below rollout.sglang_base_port (30000 by default), where the engines bind theirs
port=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 9000))}
if gpus=$(nvidia-smi -L 2>/dev/null | grep -c GPU); then :; else gpus=0; fi
nproc=${NPROC_PER_NODE:-$(( gpus > 0 ? gpus : 2 ))}

# A store of each restart's own for the workers' process groups (rank 0 hosts a new one per
# rendezvous round): on the agent's shared store a restarted worker can read a dead worker's
# address, and the nodes' restart counts, which could tell the attempts apart, can disagree
# (rollpacker/runtime/world.py, attempt_store).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

echo "rollpacker: ${#nodes[@]} node(s) x ${nproc} ranks, rendezvous ${head_node} (${head_addr}):${port}, config ${config}"
# rollpacker-train (python -m rollpacker.launcher): each node checks the run before its ranks start
# (the first node prints a refusal), then runs torchrun's agent with a c10d rendezvous
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  python -m rollpacker.launcher \
    --nnodes="${SLURM_JOB_NUM_NODES}" --nproc-per-node="${nproc}" \
    --rdzv-endpoint="${head_addr}:${port}" --rdzv-id="${SLURM_JOB_ID}" \
    --max-restarts="${MAX_RESTARTS:-3}" \
    --config "${config}" "$@"
