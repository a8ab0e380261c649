#!/usr/bin/env bash
# Set up (if needed) and train the GPT recipe; extra arguments go to recipes.train_gpt.
# The first line comes before set-up and before Python imports torch, so a run shows at once that it started.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "scripts/train.sh: checking .venv, then python -m recipes.train_gpt $*"
start=$(date +%s.%N)
./scripts/setup.sh core
echo "scripts/train.sh: .venv ready in $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')s"
exec .venv/bin/python -m recipes.train_gpt "$@"
