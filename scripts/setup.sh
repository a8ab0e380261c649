#!/usr/bin/env bash
# Create .venv with the project and its test dependencies. Idempotent; pip runs again only when
# pyproject.toml or this script changed since the last successful set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
STAMP=.venv/.cann-setup-stamp
WANT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('cann_passes')))"; then
    exit 0
fi
# torch is pinned to the 2.13 CPU build; an unpinned torch would pull the CUDA build.
.venv/bin/pip install -q --disable-pip-version-check "torch==2.13.*"
.venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
echo "$WANT" > "$STAMP"
