#!/usr/bin/env bash
# CI: hf_kvplus as a pip user gets it. Builds the wheel, installs it into a fresh venv with no extras (torch 2.13.0
# CPU first, as scripts/setup.sh does), and from a folder outside the clone runs `import hf_kvplus`, `kvplus --help`,
# `kvplus --version`, a short `kvplus demo` (a cache whose extra is missing is skipped with a line naming the extra)
# and every README snippet (scripts/snippets.py; tests/test_snippets.py runs them and docs/*.md's in the venv with
# every extra, where the test suite runs). Kept short: pip's cache and the local wheels serve the install, the demo
# runs three caches at 256 tokens.
#
# The demo and the snippets use the embedded model converted into the user cache folder ($KVPLUS_CACHE): the test
# suite converts it first (converting needs `gguf`, from the eval extra), so .ci/run calls this after the suite. The
# C++ operators are built into a folder of this run's own (TORCH_EXTENSIONS_DIR): a build from the wheel's sources
# that neither reuses nor disturbs the project venv's build. (A copy of the suite's build folder would not save it:
# its ninja file names the project venv's torch headers and libraries, so ninja sees a changed command and rebuilds.)
# Usage: bash scripts/wheel_check.sh [REPO] (default: this clone; REPO may be any checkout of the project).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPO="$(cd "${1:-$HERE}" && pwd)"
VENV="${KVPLUS_VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$HERE/$VENV" ;; esac
BUILD_PY="$VENV/bin/python"  # the project's venv has setuptools and wheel: no isolated build env to download
WORK="$(mktemp -d /tmp/kvplus-wheel.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
export TORCH_EXTENSIONS_DIR="$WORK/torch_extensions"
start=$(date +%s)
step() { echo "wheel check [$(( $(date +%s) - start )) s]: $*"; }

step "building the wheel of $REPO"
"$BUILD_PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation "$REPO" -w "$WORK/dist" \
    >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/hf_kvplus-*.whl)

step "a fresh venv: torch 2.13.0 (CPU), then $(basename "$WHEEL") without extras"
python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
# torch first, then the wheel and the dependencies its metadata names, as scripts/setup.sh installs (uv with pip's
# sources and pip's choice among indexes, else pip): about 5 s against pip's 35 s in CI for the same packages.
source "$HERE/scripts/install_packages.sh"
install_packages "$BUILD_PY" "$PY" torch==2.13.0
install_packages "$BUILD_PY" "$PY" "$WHEEL"
# Byte code as the commands below import (pip would have compiled the install; uv does not), where
# PYTHONDONTWRITEBYTECODE would have every one of them compile torch and Transformers again (scripts/install_packages.sh):
# this venv is thrown away, and only what they import gets compiled (compiling all of it took 76 s in CI).
unset PYTHONDONTWRITEBYTECODE

# Outside the clone, with nothing of it on the path: what runs is the installed wheel. Every check runs; the step
# fails at the end if any did, naming them.
mkdir "$WORK/user"
cd "$WORK/user"
unset PYTHONPATH
export PATH="$WORK/venv/bin:$PATH"
failed=()
check() {
    local name="$1"; shift
    step "$name"
    "$@" || { echo "wheel check: FAILED: $name"; failed+=("$name"); }
}
# The C++ build is one compiler process (about 80 s); it runs beside the next three checks, each one Python process
# that imports hf_kvplus, so that the two cores are both busy. The demo and the snippets run after it has finished.
step "the C++ CPU operators build from the wheel's sources: started, beside the next three checks"
"$PY" -W error::RuntimeWarning -c "import sys; from hf_kvplus.kernels import rotated_cpu; sys.exit(not rotated_cpu.available())" \
    >"$WORK/operators.log" 2>&1 &
operators=$!
operators_built() { local rc=0; wait "$operators" || rc=$?; cat "$WORK/operators.log"; return "$rc"; }
check "import hf_kvplus (from the venv, not the clone)" \
    "$PY" -c "import hf_kvplus, sys; p = hf_kvplus.__file__; print(p); sys.exit(p.startswith('$REPO/'))"
check "kvplus --help" kvplus --help
check "kvplus --version" kvplus --version
check "the C++ CPU operators built from the wheel's sources" operators_built
check "kvplus demo, three caches at 256 tokens (quanto's extra is missing: skipped)" \
    kvplus demo --context 256 --rounds 2 --new-tokens 4 --threads 2 --out "$WORK/user/demo" \
    --cache dynamic --cache quantized:k4v2 --cache hf-quantized:quanto:4 --cache sink:4:60
# The checker is this clone's; the snippets are REPO's.
check "README snippets" "$PY" "$HERE/scripts/snippets.py" --root "$REPO" "$REPO/README.md"
if [ ${#failed[@]} -gt 0 ]; then
    step "${#failed[@]} check(s) failed: ${failed[*]}"
    exit 1
fi
step "passed"
