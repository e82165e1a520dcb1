#!/usr/bin/env bash
# docs/tpu.md's table: every accelerator config's train step compiled by the TPU compiler (libtpu)
# for its target slice on this machine's CPU, one `decay-jax-memory --topology` per row, each row
# appended to OUT (JSON lines; default docs/tpu_results.jsonl, kept beside the table). Rows run
# one after another (about 1-3 minutes each on 2 cores); a row that fails prints its error and the
# rest go on. Then: python -m decay_jax.cli.memory --table=OUT   (the markdown table).
# Usage: bash launch/tpu_table.sh [OUT] [ROW_FILTER]   (ROW_FILTER: a grep pattern on the rows)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/tpu_results.jsonl}
FILTER=${2:-.}
PY=${PY:-.venv/bin/python}
export JAX_PLATFORMS=cpu
# config | slice | overrides: each config at the slice and batch its docstring names (and v5e/v6e
# rows where users would run it; 8 H100s for the configs written for them) and, beside a config's
# row, the setting it changes from the default (its dtype or remat) for comparison.
ROWS="
mae_vit_b16.py|v5p-64|
mae_vit_b16.py|v5p-64|--config.model.dtype=float32
mae_vit_b16.py|v5e-64|
mae_vit_b16_official.py|v5p-16|
mae_vit_b16_official.py|h100-8|
mae_vit_l16.py|v5p-128|
mae_vit_h14.py|v5p-128|
finetune_vit_b16.py|v5p-64|
finetune_vit_l16.py|v5p-64|
finetune_vit_h14.py|v5p-64|
sit_xl2.py|v5p-8|
sit_xl2.py|v5p-8|--config.model.remat_policy=none
sit_xl2.py|h100-8|
sit_b2.py|v4-8|
sit_s2.py|v5e-8|
sit_s2_routing.py:mirror|v5e-8|
sit_repa_xl2.py|v5p-16|
sit_repa_xl2_routing_finetune.py|v5p-16|
uvit_s2_cifar100.py|v5e-8|
uvit_m4_imagenet.py|v5p-16|
mae_vit_b16.py|v6e-64|
"
echo "$ROWS" | grep -v '^$' | grep -e "$FILTER" | while IFS='|' read -r config slice overrides; do
  echo "== $config on $slice $overrides"
  # GPU rows: the CUDA plugin's compiler from .cuda_compile/ (requirements-gpu-compile.txt)
  path=$PWD; case "$slice" in h100*) path=$PWD/.cuda_compile:$PWD;; esac
  # shellcheck disable=SC2086
  PYTHONPATH=$path "$PY" -m decay_jax.cli.memory --config="configs/$config" --topology="$slice" \
      $overrides --out="$OUT" 2>&1 | grep -v '^[WI][0-9]\{4\}' | tail -12
done
