#!/usr/bin/env bash
# Set up (if needed) and train the GPT recipe; extra arguments go to recipes.train_gpt.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m recipes.train_gpt "$@"
