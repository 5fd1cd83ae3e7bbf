#!/usr/bin/env bash
# Sets up .venv if needed, then runs the linters (ruff, then the import contracts), checks that BENCHMARKS.md is
# what eval/report.py writes from eval/results/, and runs the whole test suite (CPU; Triton kernels run under the
# Triton interpreter). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
VENV="${KVPLUS_VENV:-.venv}"
"$VENV/bin/ruff" check .
bash scripts/lint_imports.sh
"$VENV/bin/python" eval/report.py --check
"$VENV/bin/pytest" "$@"
