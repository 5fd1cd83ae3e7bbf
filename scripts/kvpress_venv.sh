#!/usr/bin/env bash
# A venv for NVIDIA kvpress (0.5.5 needs transformers < 5.3, older than hf_kvplus's), for
# eval/compare_kvpress.py --kvpress-python <venv>/bin/python. Usage: bash scripts/kvpress_venv.sh [folder]
set -euo pipefail
venv="${1:-.venv-kvpress}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0            # the CPU wheel first: a bare torch pulls CUDA packages
"$venv/bin/pip" install -q kvpress==0.5.5 "transformers>=4.56,<5.3"
echo "kvpress venv ready: $venv/bin/python"
