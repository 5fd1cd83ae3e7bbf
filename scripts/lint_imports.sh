#!/usr/bin/env bash
# Checks the import contracts of pyproject.toml ([tool.importlinter]) with lint-imports. lint-imports reads a
# package from its folder, where kernels/ is absent (it sits at the top and ships as hf_kvplus.kernels): so it runs
# in a temporary tree of links laid out as installed, hf_kvplus/ with kernels/ inside.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${KVPLUS_VENV:-.venv}"
repo="$PWD"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/hf_kvplus"
ln -s "$repo"/hf_kvplus/* "$tree/hf_kvplus/"
ln -s "$repo/kernels" "$tree/hf_kvplus/kernels"
cd "$tree"
"$repo/$VENV/bin/lint-imports" "$repo/pyproject.toml" --no-cache
