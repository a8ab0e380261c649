#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/install_browser.sh
exec .venv/bin/python -m pytest -q -ra -n 2 -p no:cacheprovider "$@"
