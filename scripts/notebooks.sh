#!/usr/bin/env bash
# Sets up .venv if needed, then executes the notebooks in notebooks/ top to bottom and saves them in place with
# their outputs (text and PNG figures), so that a reader browsing the repository sees the plots. Runs on the
# embedded model (smollm2-135m) and text (Pride and Prejudice), offline: 9 minutes on 2 shared cores (18 under
# load). Arguments: notebook paths (default: all of them). tests/test_notebooks.py checks the saved outputs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
VENV="${KVPLUS_VENV:-.venv}"
# Same hashes, no progress bars (weights loading, needle trials) and no tqdm warning about widgets: the outputs
# change only when the results do.
export PYTHONHASHSEED=0 TQDM_DISABLE=1 PYTHONWARNINGS="ignore:IProgress not found"
"$VENV/bin/python" scripts/execute_notebooks.py "$@"
