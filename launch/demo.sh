#!/usr/bin/env bash
# The README's main command: on a fresh machine with Python 3.11, installs the pinned requirements
# into .venv and trains a decayed MAE (alpha_min 0.6) and a baseline (alpha_min 1.0) with the same
# budget on the embedded MNIST digits, then prints their KNN accuracies. Output: ${1:-workdir/demo}.
# Further flags go to decay_jax.cli.compare: --seeds=3 gives the README's table with 95% intervals.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/venv.sh requirements.txt
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
[ "$JAX_PLATFORMS" != cpu ] || source launch/cpu_env.sh
WORKDIR=${1:-workdir/demo}
shift || true
exec .venv/bin/python -m decay_jax.cli.compare --config=configs/mae_cpu_mnist.py \
  --workdir="$WORKDIR" --alphas=0.6,1.0 "$@"
