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
# Python keeps no bytecode of what it imports where PYTHONDONTWRITEBYTECODE is set, and uv writes
# none unless asked: every process would compile torch's and transformers' sources again (about
# 2 s of a bare `import torch`, 5 s of building a transformers model on 2 cores), and the test
# suite starts a few hundred. With the test dependencies the installed packages are compiled once
# at install (about 19 s on 2 cores; also after a `core` set-up, which leaves it to the imports for
# a sooner first step of scripts/train.sh). The project's own sources are compiled on every set-up
# (compileall skips what is up to date).
compile_project() {
    .venv/bin/python -m compileall -q -j 0 cann_passes graph_ir recipes tools tests bench >/dev/null
}
compile_packages() {
    .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
}
# A set-up with the test dependencies serves training too.
if { [ "$HAVE" = "$WANT $EXTRAS" ] || [ "$HAVE" = "$WANT test" ]; } && .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('cann_passes')))"; then
    compile_project
    exit 0
fi
# torch is pinned to the 2.13 CPU build (an unpinned torch would pull the CUDA build); one run
# resolves it with the project's dependencies. uv installs the same set in seconds where pip
# takes most of a minute (torch unpacks 1 GB), so it is used when a CPU wheel of torch 2.13 lies
# in pip's find-links (uv reads no pip configuration, and the index's default torch is the CUDA
# build); otherwise, or if uv cannot be had or fails, pip does it.
FIND_LINKS=${PIP_FIND_LINKS:-$(.venv/bin/pip config get global.find-links 2>/dev/null || true)}
UV_LINKS=()
for dir in $FIND_LINKS; do
    if compgen -G "$dir/torch-2.13.*+cpu-*.whl" >/dev/null; then
        UV_LINKS+=(--find-links "$dir")
    fi
done
if [ ${#UV_LINKS[@]} -gt 0 ] && .venv/bin/pip install -q --disable-pip-version-check uv >/dev/null 2>&1 \
        && .venv/bin/uv pip install -q --python .venv/bin/python "${UV_LINKS[@]}" "torch==2.13.*" -e "$SPEC"; then
    :
else
    .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.*" -e "$SPEC"
fi
if [ "$EXTRAS" = test ]; then
    compile_packages
fi
compile_project
echo "$WANT $EXTRAS" > "$STAMP"
