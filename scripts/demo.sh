#!/usr/bin/env bash
# Sets up .venv if needed, then runs the demo: SmolLM2-135M generating with DynamicCache and DenseCache.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
VENV="${KVPLUS_VENV:-.venv}"
"$VENV/bin/python" -m hf_kvplus.demo "$@"
