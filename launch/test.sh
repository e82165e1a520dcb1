#!/usr/bin/env bash
# The README's test command: makes .venv (Python 3.11) if needed, installs the pinned test
# requirements, and runs the whole suite on CPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-test.txt
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-2}" --durations=15 tests "$@"
