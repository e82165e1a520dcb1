# Sourced by the CPU launch scripts (and by hand before `python -m research.small_scale_study.run` or `main` on
# CPU): keeps glibc from unmapping XLA:CPU's per-step scratch memory. Usage: source launch/cpu_env.sh
#
# Why: XLA:CPU allocates all temporaries of one execution as a single block (2.06 GB for the study's
# MAE-tiny train step at batch 128). glibc serves a block that large from a worker thread's arena
# with mmap and unmaps it on free, so every step faults the whole block in again: 100-140 thousand
# page faults a second and 20-30% of the CPU time in the kernel on a 2-core machine. One arena, no
# mmap and no trimming keep the block mapped after the first step: 0 faults a second, 1-2% kernel
# time. Steps/s in neighbouring 5-minute blocks of the study's training (2-core AMD EPYC,
# 2026-12-02): +24%, +6%, +35%, +36%; `bench`'s bare train step (no input pipeline) showed no
# difference. Only glibc reads GLIBC_TUNABLES; elsewhere (macOS) this is a no-op. Memory stays at
# the run's peak.
_DECAY_JAX_MALLOC="glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
case "${GLIBC_TUNABLES:-}" in
  *glibc.malloc.*) ;;  # the user chose malloc settings already: leave them
  *) export GLIBC_TUNABLES="${GLIBC_TUNABLES:+${GLIBC_TUNABLES}:}${_DECAY_JAX_MALLOC}" ;;
esac
unset _DECAY_JAX_MALLOC
# One OpenBLAS thread: jax's CPU SVD/eigh (the rank evaluator) call scipy's OpenBLAS, whose default
# of one thread per core fights XLA's thread pool (see decay_jax/cli/__init__.py).
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
