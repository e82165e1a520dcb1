#!/usr/bin/env bash
# The README's test command: installs SLURM for tests/test_slurm.py where it can (launch/slurm_deps.sh),
# makes .venv (Python 3.11) if needed, installs the pinned test requirements (those of
# requirements-test-nodeps.txt without their dependencies: see there), and runs the whole suite on
# CPU. Extra arguments go to pytest. Each xdist worker takes whole modules (--dist loadscope), so a
# module's compiled fixtures are built once; tests/conftest.py shares one JAX compilation cache.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/slurm_deps.sh
source launch/venv.sh requirements-test.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-test-nodeps.txt
# The CUDA plugin's compiler for the GPU compile test, apart from .venv (requirements-gpu-compile.txt).
[ -f .cuda_compile/.installed ] && cmp -s requirements-gpu-compile.txt .cuda_compile/.installed || {
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --upgrade \
      --target .cuda_compile -r requirements-gpu-compile.txt && cp requirements-gpu-compile.txt .cuda_compile/.installed; }
# The linter first (pyproject.toml [tool.ruff]); a finding fails the run as a test would.
.venv/bin/ruff check --quiet decay_jax tests research launch
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder \
    --durations=15 tests "$@"
