#!/usr/bin/env bash
# Train on every worker of a Cloud TPU VM slice (one process per host, all hosts at once).
#   TPU_NAME=my-v4-64 ZONE=us-central2-b bash launch/tpu_pod.sh configs/mae_vit_b16.py \
#       gs://bucket/runs/mae_b16 [--config.field=value ...]
# The repository is copied to ~/decay-jax on each worker; each worker installs jax[tpu] and runs
# launch/local.sh with DECAY_JAX_DISTRIBUTED=1 (jax.distributed.initialize() finds the slice by
# itself on TPU VMs). WORKDIR must be visible to all hosts (a gs:// path or a shared filesystem).
# The TFDS data must be prepared once (see docs/training.md) and readable by all hosts (data.data_dir).
# DRY_RUN=1 prints the gcloud commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: TPU_NAME=.. ZONE=.. $0 CONFIG WORKDIR [overrides]" >&2; exit 2; }
: "${TPU_NAME:?set TPU_NAME to the TPU VM name}" "${ZONE:?set ZONE to the TPU zone}"
CONFIG=$1; WORKDIR=$2; shift 2
run() { if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi; }
ARCHIVE=$(mktemp -d)/decay-jax.tar.gz
git archive --format=tar.gz -o "$ARCHIVE" HEAD
run gcloud compute tpus tpu-vm scp "$ARCHIVE" "$TPU_NAME:~/decay-jax.tar.gz" --zone="$ZONE" --worker=all
REMOTE="rm -rf ~/decay-jax && mkdir -p ~/decay-jax && tar xzf ~/decay-jax.tar.gz -C ~/decay-jax"
REMOTE+=" && cd ~/decay-jax && DECAY_JAX_DISTRIBUTED=1 JAX_EXTRA=tpu bash launch/local.sh"
REMOTE+=" $(printf '%q ' "$CONFIG" "$WORKDIR" "$@")"
run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="$REMOTE"
