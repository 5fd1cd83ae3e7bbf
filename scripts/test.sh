#!/usr/bin/env bash
# Sets up .venv if needed, then runs the linters (ruff, then the import contracts), checks that BENCHMARKS.md is
# what eval/report.py writes from eval/results/, and runs the whole test suite (CPU; Triton kernels run under the
# Triton interpreter). Extra arguments go to pytest. With none (CI: .ci/run), the conformance tests then run again
# on the lowest Transformers pyproject.toml supports, beside the check of the wheel as a pip user gets it
# (scripts/wheel_check.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
source scripts/install_packages.sh  # compile_bytecode
VENV="${KVPLUS_VENV:-.venv}"
# The C++ code the suite builds on a fresh venv (hf_kvplus's CPU operators, about 80 s; optimum-quanto's CPU unpack,
# about 60 s; nothing once built), one compiler at a time, beside the linters and the suite's collection, which leave
# a core idle. Otherwise the first test that needs it builds it, and the other worker's tests that need it too wait on
# the build's lock. A failed build is left to the tests, which report it.
"$VENV/bin/python" - >/dev/null 2>&1 <<'PY' &
import importlib.util

from hf_kvplus.kernels import rotated_cpu

rotated_cpu.available()
if importlib.util.find_spec("optimum.quanto"):
    from optimum.quanto.library.extensions import get_extension

    get_extension("quanto_cpp").lib
PY
"$VENV/bin/ruff" check .
bash scripts/lint_imports.sh
"$VENV/bin/python" eval/report.py --check
# Without arguments the wheel check below runs README.md's snippets from the installed wheel: the suite leaves them to it
[ $# -eq 0 ] && export KVPLUS_README_IN_WHEEL_CHECK=1
"$VENV/bin/pytest" -n "${KVPLUS_TEST_WORKERS:-auto}" --dist worksteal --durations=50 "$@"
[ $# -eq 0 ] || exit 0

# The lowest supported Transformers (pyproject's `transformers>=X.Y`, as X.Y.*), installed apart in $LOWEST and put
# first on the path, so that it shadows the venv's newest for the conformance tests and the cache keyword's tests:
# every cache and generate mode on two of the four architectures, Llama (full attention) and Gemma 3 (sliding and
# full layers, QK-norm); what differs between Transformers versions is the cache contract and the generate paths,
# which those two exercise (Mistral and Qwen2 add sliding layers Gemma 3 has; the suite runs all four on the newest).
# --no-deps: the venv has the rest; 5.17 differs in wanting huggingface-hub < 2, which imports httpx.
LOWEST_VERSION=$(sed -n 's/^ *"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)
LOWEST="$VENV/transformers-$LOWEST_VERSION"
if ! compgen -G "$LOWEST/transformers-$LOWEST_VERSION.*.dist-info" >/dev/null; then
    rm -rf "$LOWEST"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile --no-deps --target "$LOWEST" \
        "transformers==$LOWEST_VERSION.*" "huggingface-hub>=1.5,<2" "httpx<1" httpcore
    compile_bytecode "$VENV/bin/python" "$LOWEST"
fi
# The wheel check runs beside them: it is mostly one process at a time (pip, one compiler, the demo, the snippets),
# and the conformance run leaves a core idle while it starts its workers and collects, so each fills the other's
# idle core. The check's output comes after the tests' (from its log), in one piece.
WHEEL_LOG=$(mktemp /tmp/kvplus-wheel-check.XXXXXX.log)
bash scripts/wheel_check.sh </dev/null >"$WHEEL_LOG" 2>&1 &
wheel=$!
echo "conformance on transformers $LOWEST_VERSION.*, beside the wheel check"
start=$(date +%s)
status=0
PYTHONPATH="$LOWEST" KVPLUS_EXPECT_TRANSFORMERS="$LOWEST_VERSION" "$VENV/bin/pytest" -p no:cacheprovider \
    -n "${KVPLUS_TEST_WORKERS:-auto}" \
    -k "not mistral and not qwen2" tests/test_conformance.py tests/test_transformers_compat.py || status=$?
echo "conformance on transformers $LOWEST_VERSION.*: $(( $(date +%s) - start )) s"
wait "$wheel" || status=$?
cat "$WHEEL_LOG"
rm -f "$WHEEL_LOG"
exit "$status"
