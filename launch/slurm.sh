#!/usr/bin/env bash
# Multi-GPU, multi-host training under SLURM: one process per GPU, all hosts in one job.
#   sbatch --nodes=2 --gpus-per-node=8 --ntasks-per-node=8 --cpus-per-task=12 \
#       launch/slurm.sh configs/mae_vit_b16.py /shared/runs/mae_b16 [--config.field=value ...]
# Set up the environment once, on a login node:
#   python3.11 -m venv .venv && .venv/bin/pip install -r requirements.txt "jax[cuda12]==$(sed -n 's/^jax==//p' requirements.txt)"
# Each task sees only its own GPU (CUDA_VISIBLE_DEVICES=$SLURM_LOCALID) and joins the job through
# jax.distributed.initialize(), which reads the SLURM environment. WORKDIR must be on a filesystem
# that every node sees. DRY_RUN=1 prints the srun command.
# CPU-only nodes (tests/test_slurm.py runs this on a one-node cluster on localhost): override the
# GPU directives and choose the platform through the environment, which srun passes to every task:
#   JAX_PLATFORMS=cpu sbatch --gpus-per-node=0 --ntasks=2 --ntasks-per-node=2 launch/slurm.sh ...
# With JAX_PLATFORMS=cpu the tasks get launch/cpu_env.sh's malloc settings; GPU runs are unchanged.
#SBATCH --job-name=decay-jax
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=8
#SBATCH --output=slurm-%j.out
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: sbatch [options] $0 CONFIG WORKDIR [overrides]" >&2; exit 2; }
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
[ -x .venv/bin/python ] || { echo "error: .venv missing; see the setup line at the top of $0" >&2; exit 2; }
CONFIG=$1; WORKDIR=$2; shift 2
[ "${JAX_PLATFORMS:-}" != cpu ] || source launch/cpu_env.sh
CMD=(srun --kill-on-bad-exit=1 bash -c
     'CUDA_VISIBLE_DEVICES=$SLURM_LOCALID DECAY_JAX_DISTRIBUTED=1 exec .venv/bin/python -m decay_jax.cli.train "$@"'
     _ --config="$CONFIG" --workdir="$WORKDIR" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "${CMD[@]}"; echo; else exec "${CMD[@]}"; fi
