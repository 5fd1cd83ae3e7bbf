#!/usr/bin/env bash
# Sets up .venv if needed, then runs the main job: `kvplus demo` (every cache vs the baselines on SmolLM2-135M
# and Pride and Prejudice: perplexity, bytes per token, decode speed). Arguments go to `kvplus demo`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
VENV="${KVPLUS_VENV:-.venv}"
"$VENV/bin/kvplus" demo "$@"
