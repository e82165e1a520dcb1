#!/usr/bin/env bash
# GPU benchmark of the train step: SiT-XL/2 and MAE ViT-L/16 in bfloat16 with cuDNN attention on
# every GPU of this host; prints images/s and MFU against the device's dense bf16 peak
# (decay_jax/models/flops.py; unknown GPUs get no MFU).
#   bash launch/gpu_bench.sh [OUT.jsonl]        # default OUT: /tmp/decay_jax_gpu_bench.jsonl
# Installs the pinned JAX's CUDA build (JAX_EXTRA=cuda12, or cuda13) into .venv unless JAX already
# sees a GPU (offline machines with a ready .venv install nothing). Per-device batches:
# SIT_BATCH (default 64, the official 256 over 4 GPUs) and MAE_BATCH (default 128); STEPS timed
# steps (default 20); FSDP shards parameters over that many GPUs (default 1); REMAT (none, full or
# dots) overrides the configs' remat policy, to measure its time cost.
# BENCH_PLATFORM=cpu runs the same two commands on CPU with tiny models, XLA attention and 2 steps
# (a check of this script; those numbers mean nothing). DRY_RUN=1 prints the commands.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/decay_jax_gpu_bench.jsonl}
PY=.venv/bin/python
PLATFORM=${BENCH_PLATFORM:-gpu}
STEPS=${STEPS:-20}
ATTENTION=cudnn
case "$PLATFORM" in
  gpu) TINY=() ;;
  cpu) export JAX_PLATFORMS=cpu; STEPS=2; ATTENTION=xla; SIT_BATCH=2; MAE_BATCH=2
       TINY=(--config.model.preset=micro/4 --config.data.image_size=16) ;;
  *) echo "error: BENCH_PLATFORM=$PLATFORM is not allowed; choose gpu or cpu" >&2; exit 2 ;;
esac
COMMON=(--steps="$STEPS" --out="$OUT" --config.model.dtype=bfloat16
        --config.model.attention_impl="$ATTENTION" --config.mesh.data=-1
        --config.mesh.fsdp="${FSDP:-1}" ${REMAT:+--remat="$REMAT"} "${TINY[@]}")
SIT=(-m decay_jax.cli.bench --config=configs/sit_xl2.py --batch_per_device="${SIT_BATCH:-64}" "${COMMON[@]}")
MAE=(-m decay_jax.cli.bench --config=configs/mae_vit_l16.py --batch_per_device="${MAE_BATCH:-128}" "${COMMON[@]}")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "$PY" "${SIT[@]}"; echo
  printf '%q ' "$PY" "${MAE[@]}"; echo
  exit 0
fi

if [ "$PLATFORM" = gpu ] && ! { [ -x "$PY" ] && "$PY" -c "import jax; jax.devices('gpu')" >/dev/null 2>&1; }; then
  EXTRA=${JAX_EXTRA:-cuda12}
  case "$EXTRA" in
    cuda12|cuda13) ;;
    *) echo "error: JAX_EXTRA=$EXTRA is not allowed; choose cuda12 or cuda13" >&2; exit 2 ;;
  esac
  source launch/venv.sh requirements.txt
  "$PY" -m pip install -q "jax[$EXTRA]==$(sed -n 's/^jax==//p' requirements.txt)"
  "$PY" -c "import jax; print('GPUs:', jax.devices('gpu'))"
fi
[ -x "$PY" ] || source launch/venv.sh requirements.txt

: > "$OUT"
"$PY" "${SIT[@]}"
"$PY" "${MAE[@]}"
"$PY" - "$OUT" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"\n{rows[0]['devices']} x {rows[0]['device_kind']}")
print("| model | dtype | global batch | images/s | images/s/device | model TFLOP/s/device | MFU |")
print("|---|---|---:|---:|---:|---:|---:|")
for r in rows:
  mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "n/a (unknown peak)"
  print(f"| {r['config']} ({r['preset']}) | {r['dtype']} | {r['global_batch']} | "
        f"{r['images_per_sec']} | {r['images_per_sec_per_device']} | "
        f"{r['model_tflops_per_sec_per_device']} | {mfu} |")
EOF
