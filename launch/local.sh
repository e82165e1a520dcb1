#!/usr/bin/env bash
# Train any config on this machine (CPU, one GPU host, or one TPU VM), installing what it needs.
#   bash launch/local.sh configs/mae_vit_b16.py WORKDIR [--config.field=value ...]
# JAX_EXTRA picks the accelerator build of the pinned JAX: cuda12 (NVIDIA GPUs), tpu, or empty (CPU).
# Rerunning the same command resumes from WORKDIR. With DECAY_JAX_DISTRIBUTED=1 the process joins
# a multi-host job through jax.distributed.initialize() (tpu_pod.sh and slurm.sh set it).
# DRY_RUN=1 prints the training command and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 CONFIG WORKDIR [--config.field=value ...]" >&2; exit 2; }
CONFIG=$1; WORKDIR=$2; shift 2
[ -f "$CONFIG" ] || { echo "error: config file $CONFIG not found" >&2; exit 2; }
CMD=(.venv/bin/python -m decay_jax.cli.train --config="$CONFIG" --workdir="$WORKDIR" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
source launch/venv.sh requirements.txt
JAX_VERSION=$(sed -n 's/^jax==//p' requirements.txt)
case "${JAX_EXTRA:-}" in
  "") source launch/cpu_env.sh ;;
  cuda12|tpu) .venv/bin/python -m pip install -q "jax[${JAX_EXTRA}]==${JAX_VERSION}" ;;
  *) echo "error: JAX_EXTRA=${JAX_EXTRA} is not allowed; choose cuda12, tpu or leave it empty" >&2; exit 2 ;;
esac
exec "${CMD[@]}"
