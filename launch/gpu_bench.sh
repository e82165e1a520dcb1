#!/usr/bin/env bash
# GPU benchmark of the train step on one host, in bfloat16, in order of importance: SiT-XL/2 at the
# best setting measured so far (cuDNN attention, remat dots), MAE ViT-L/16 with cuDNN attention
# (odd token counts padded, layers.attend), SiT-XL/2 at batch 128, remat dots_context (the
# attention output saved too), XLA:GPU's cuDNN GEMM fusions
# and cuBLAS instead of Triton GEMMs, then the earlier A/Bs (MAE with XLA attention, MaxText's
# flags, XLA attention, batch, remat none/full). Prints a table of images/s and MFU against the
# device's dense bf16 peak (FLOPs = 2 x multiply-adds, decay_jax/models/flops.py; unknown GPUs get
# no MFU).
#   bash launch/gpu_bench.sh OUTDIR
# Writes OUTDIR/bench.jsonl (one line per case), OUTDIR/bench.md (the table), OUTDIR/bench.log.
# Installs the pinned JAX's CUDA build (JAX_EXTRA=cuda12, or cuda13) into .venv unless PYTHON (or
# .venv/bin/python) already sees a GPU. SIT_BATCH (default 64, the official 256 over 4 GPUs) and
# MAE_BATCH (default 128) are the per-GPU batches of the headline cases; STEPS timed steps per
# repeat (default 10) and REPEATS (default 3): the table gives the median repeat; FSDP shards
# parameters over that many GPUs (default 1); BUDGET_S (default 0: none) skips the cases that would
# start after that many seconds (they are listed in order of importance).
# BENCH_PLATFORM=cpu runs the two headline cases and one case with every XLA flag of the flag
# cases at once on CPU with tiny models, XLA attention and 2 steps (a check of this script and
# that the flags parse; those numbers mean nothing). DRY_RUN=1 prints the commands.
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?usage: bash launch/gpu_bench.sh OUTDIR}
PY=${PYTHON:-.venv/bin/python}
PLATFORM=${BENCH_PLATFORM:-gpu}
STEPS=${STEPS:-10}
REPEATS=${REPEATS:-3}
ATTENTION=cudnn
SIT_BATCH=${SIT_BATCH:-64}
MAE_BATCH=${MAE_BATCH:-128}
# MaxText's single-host GPU flags that act on one process: the latency-hiding scheduler, cuBLAS
# GEMMs instead of Triton's, no CUDA command buffers (graphs).
MAXTEXT_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false --xla_gpu_enable_command_buffer="
case "$PLATFORM" in
  gpu) TINY=() ;;
  cpu) export JAX_PLATFORMS=cpu; STEPS=2; REPEATS=1; ATTENTION=xla; SIT_BATCH=2; MAE_BATCH=2
       TINY=(--config.model.preset=micro/4 --config.data.image_size=16) ;;
  *) echo "error: BENCH_PLATFORM=$PLATFORM is not allowed; choose gpu or cpu" >&2; exit 2 ;;
esac
COMMON=(--steps="$STEPS" --repeats="$REPEATS" --out="$OUTDIR/bench.jsonl"
        --config.model.dtype=bfloat16 --config.mesh.data=-1 --config.mesh.fsdp="${FSDP:-1}" "${TINY[@]}")
SIT=(-m decay_jax.cli.bench --config=configs/sit_xl2.py "${COMMON[@]}")
MAE=(-m decay_jax.cli.bench --config=configs/mae_vit_l16.py "${COMMON[@]}")
# XLA:GPU flags of the A/Bs: cuDNN GEMM fusions (Hopper and cuDNN 9; off by default) and cuBLAS
# GEMMs instead of Triton's.
CUDNN_GEMM_FLAGS="--xla_gpu_cudnn_gemm_fusion_level=2"
NO_TRITON_FLAGS="--xla_gpu_enable_triton_gemm=false"
# One case per line: XLA_FLAGS (- for none) | the bench's arguments. In order of importance.
BEST_SIT="${SIT[*]} --batch_per_device=$SIT_BATCH --config.model.attention_impl=$ATTENTION --remat=dots"
CASES=("-|$BEST_SIT"
       "-|${MAE[*]} --batch_per_device=$MAE_BATCH --config.model.attention_impl=$ATTENTION"
       "$CUDNN_GEMM_FLAGS|$BEST_SIT"
       "$NO_TRITON_FLAGS|$BEST_SIT"
       "$MAXTEXT_FLAGS|$BEST_SIT")
if [ "$PLATFORM" = cpu ]; then  # every flag in one process: they parse, at a third of the cost
  CASES=("${CASES[0]}" "${CASES[1]}" "$CUDNN_GEMM_FLAGS $MAXTEXT_FLAGS|$BEST_SIT")
else
  CASES=("${CASES[0]}" "${CASES[1]}"
         "-|${SIT[*]} --batch_per_device=$((SIT_BATCH * 2)) --config.model.attention_impl=cudnn --remat=dots"
         "-|${SIT[*]} --batch_per_device=$SIT_BATCH --config.model.attention_impl=cudnn --remat=dots_context"
         "${CASES[@]:2}"
         "-|${MAE[*]} --batch_per_device=$MAE_BATCH --config.model.attention_impl=xla"
         "-|${MAE[*]} --batch_per_device=$MAE_BATCH --config.model.attention_impl=cudnn --remat=dots"
         "-|${SIT[*]} --batch_per_device=$SIT_BATCH --config.model.attention_impl=cudnn"
         "-|${SIT[*]} --batch_per_device=$SIT_BATCH --config.model.attention_impl=xla --remat=dots"
         "-|${SIT[*]} --batch_per_device=$SIT_BATCH --config.model.attention_impl=cudnn --remat=full"
         "-|${SIT[*]} --batch_per_device=$((SIT_BATCH / 2)) --config.model.attention_impl=cudnn --remat=dots")
fi
if [ "${DRY_RUN:-0}" = 1 ]; then
  for c in "${CASES[@]}"; do
    f=${c%%|*}; [ "$f" = - ] || printf 'XLA_FLAGS=%q ' "$f"; echo "$PY ${c#*|}"
  done
  exit 0
fi

if [ "$PLATFORM" = gpu ] && ! { command -v "$PY" >/dev/null && "$PY" -c "import jax; jax.devices('gpu')" >/dev/null 2>&1; }; then
  EXTRA=${JAX_EXTRA:-cuda12}
  case "$EXTRA" in
    cuda12|cuda13) ;;
    *) echo "error: JAX_EXTRA=$EXTRA is not allowed; choose cuda12 or cuda13" >&2; exit 2 ;;
  esac
  source launch/venv.sh requirements.txt
  PY=.venv/bin/python
  "$PY" -m pip install -q "jax[$EXTRA]==$(sed -n 's/^jax==//p' requirements.txt)"
  "$PY" -c "import jax; print('GPUs:', jax.devices('gpu'))"
fi
command -v "$PY" >/dev/null || { source launch/venv.sh requirements.txt; PY=.venv/bin/python; }

mkdir -p "$OUTDIR"
: > "$OUTDIR/bench.jsonl"
start=$(date +%s)
failed=0
for c in "${CASES[@]}"; do
  f=${c%%|*}; [ "$f" = - ] && f=""
  elapsed=$(( $(date +%s) - start ))
  if [ "${BUDGET_S:-0}" -gt 0 ] && [ "$elapsed" -ge "${BUDGET_S}" ]; then
    echo "skipped after ${elapsed} s (BUDGET_S=$BUDGET_S): ${c#*|}" | tee -a "$OUTDIR/bench.log"
    continue
  fi
  echo "=== [${elapsed} s] XLA_FLAGS='$f' ${c#*|}" | tee -a "$OUTDIR/bench.log"
  # shellcheck disable=SC2086  # the case's arguments hold no spaces
  if ! XLA_FLAGS="$f" "$PY" ${c#*|} >> "$OUTDIR/bench.log" 2>&1; then
    echo "failed; the end of $OUTDIR/bench.log:"; tail -n 5 "$OUTDIR/bench.log"; failed=1
  fi
done
"$PY" - "$OUTDIR/bench.jsonl" <<'PYEOF' | tee "$OUTDIR/bench.md"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
if not rows:
  sys.exit("no case finished")
print(f"{rows[0]['devices']} x {rows[0]['device_kind']}; median of {rows[0]['repeats']} windows of "
      f"{rows[0]['steps']} steps (min in brackets)\n")
print("| model | attention | remat | XLA flags | batch/device | step ms | images/s/device | "
      "model GFLOP/image | TFLOP/s/device | MFU | compile s |")
print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
  mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "n/a"
  flags = ("MaxText" if "latency_hiding" in r["xla_flags"] else
           " ".join(f.replace("--xla_gpu_", "") for f in r["xla_flags"].split()) or "default")
  print(f"| {r['config']} ({r['preset']}, {r['dtype']}) | {r['attention']} | {r['remat']} | "
        f"{flags} | {r['global_batch'] // r['devices']} | {1e3 * r['step_seconds']:.1f} "
        f"({1e3 * r['step_seconds_min']:.1f}) | {r['images_per_sec_per_device']} | "
        f"{r['model_gflops_per_example']:.1f} | {r['model_tflops_per_sec_per_device']} | {mfu} | "
        f"{r['compile_seconds']} |")
PYEOF
exit $failed
