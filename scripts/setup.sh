#!/usr/bin/env bash
# Create .venv with the project: `setup.sh core` installs what training needs (what
# scripts/train.sh asks for, so its first step comes sooner on a fresh clone); `setup.sh` or
# `setup.sh test` adds the test suite's dependencies (pytest, transformers, peft). Idempotent: pip
# runs again only when pyproject.toml or this script changed since the last successful set-up, or
# when the test dependencies are asked for after a core one.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${1:-test}
case "$EXTRAS" in
    core) SPEC="." ;;
    test) SPEC=".[test]" ;;
    *) echo "usage: scripts/setup.sh [core|test]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
STAMP=.venv/.cann-setup-stamp
WANT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
HAVE=$(cat "$STAMP" 2>/dev/null || true)
# A set-up with the test dependencies serves training too.
if { [ "$HAVE" = "$WANT $EXTRAS" ] || [ "$HAVE" = "$WANT test" ]; } && .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('cann_passes')))"; then
    exit 0
fi
# torch is pinned to the 2.13 CPU build (an unpinned torch would pull the CUDA build); one pip run
# resolves it with the project's dependencies.
.venv/bin/pip install -q --disable-pip-version-check "torch==2.13.*" -e "$SPEC"
echo "$WANT $EXTRAS" > "$STAMP"
