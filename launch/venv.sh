# Sourced by the launch scripts: makes .venv (Python 3.11 preferred) and installs a requirements
# file into it, quietly. Usage: source launch/venv.sh REQUIREMENTS_FILE
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r "$1"
