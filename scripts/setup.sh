#!/usr/bin/env bash
# Create .venv with the project and its test dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# torch is pinned to the 2.13 CPU build; an unpinned torch would pull the CUDA build.
.venv/bin/pip install -q --disable-pip-version-check "torch==2.13.*"
.venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
