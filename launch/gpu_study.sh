#!/usr/bin/env bash
# The small-scale study's alpha_min 0.6 / 0.8 / 1.0 arms on one GPU at ten times the CPU grid's
# budget (300 epochs of MAE-tiny on 8,000 CIFAR-10 images; research/small_scale_study/config_gpu.py),
# the three arms trained at once on the one GPU, each evaluated as the CPU study's arms are, then
# one table and plots over the three.
#   bash launch/gpu_study.sh OUTDIR
# Writes OUTDIR/study/<arm>/ (workdirs), OUTDIR/study/study.md, study.json and the plots, a copy
# of each arm's study_record.json as OUTDIR/<arm>.json, and OUTDIR/<arm>.log.
# NPZ: the CIFAR-10 file (default: the study config's data.dataset); EPOCHS
# (default 300); WORKERS: Grain worker processes per arm (default 3); PYTHON: the interpreter
# (default .venv/bin/python, made by launch/venv.sh when missing).
# BENCH_PLATFORM=cpu runs the same commands on CPU on a generated 224-image npz with the config's
# cpu_check variant (micro model, half an epoch): a check of this script; its numbers mean nothing.
# DRY_RUN=1 prints the commands.
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?usage: bash launch/gpu_study.sh OUTDIR}
PY=${PYTHON:-.venv/bin/python}
PLATFORM=${BENCH_PLATFORM:-gpu}
ARMS=(a0.6 a0.8 a1)
case "$PLATFORM" in
  gpu) CONFIG=research/small_scale_study/config_gpu.py; EPOCHS=${EPOCHS:-300}
       WORKERS=${WORKERS:-3}
       # Three processes share the GPU: each takes a quarter of its memory, not the default 75%.
       export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.25} ;;
  cpu) export JAX_PLATFORMS=cpu; CONFIG=research/small_scale_study/config_gpu.py:cpu_check
       EPOCHS=0.5; WORKERS=0; NPZ=${NPZ:-$OUTDIR/check.npz} ;;
  *) echo "error: BENCH_PLATFORM=$PLATFORM is not allowed; choose gpu or cpu" >&2; exit 2 ;;
esac
WORK=$OUTDIR/study
COMMON=(-m research.small_scale_study.run --config="$CONFIG" --workdir="$WORK" --grid=long
        --long_epochs="$EPOCHS" --config.data.num_workers="$WORKERS"
        ${NPZ:+--config.data.dataset=npz:$NPZ})
name() { echo "$1_lr0.001_e$(printf %g "$EPOCHS")"; }
if [ "${DRY_RUN:-0}" = 1 ]; then
  for a in "${ARMS[@]}"; do printf '%q ' "$PY" "${COMMON[@]}" --only="$(name "$a")"; echo; done
  printf '%q ' "$PY" "${COMMON[@]}" --report_only; echo
  exit 0
fi
command -v "$PY" >/dev/null || { source launch/venv.sh requirements.txt; PY=.venv/bin/python; }
mkdir -p "$WORK"
if [ "$PLATFORM" = cpu ] && [ ! -f "$NPZ" ]; then
  # Four classes told apart by brightness, 16 px: a task the probes can learn in seconds.
  "$PY" - "$NPZ" <<'PYEOF'
import sys
import numpy as np
rng = np.random.default_rng(0)
labels = np.arange(224) % 4
x = np.clip(rng.normal(40 + 50 * labels[:, None, None, None], 25, (224, 16, 16, 3)), 0, 255)
np.savez(sys.argv[1], x_train=x.astype(np.uint8), y_train=labels.astype(np.int64))
PYEOF
fi
start=$(date +%s)
pids=()
for a in "${ARMS[@]}"; do
  n=$(name "$a")
  "$PY" "${COMMON[@]}" --only="$n" > "$OUTDIR/$n.log" 2>&1 &
  pids+=($!)
  echo "arm $n: started (log $OUTDIR/$n.log)"
done
status=0
for i in "${!pids[@]}"; do
  n=$(name "${ARMS[$i]}")
  if wait "${pids[$i]}"; then
    echo "arm $n: done after $(( $(date +%s) - start )) s"
    cp "$WORK/$n/study_record.json" "$OUTDIR/$n.json"
  else
    echo "arm $n: failed; the end of $OUTDIR/$n.log:" >&2
    tail -n 5 "$OUTDIR/$n.log" >&2
    status=1
  fi
done
"$PY" "${COMMON[@]}" --report_only
echo "three arms in $(( $(date +%s) - start )) s; table and plots in $WORK"
exit $status
