#!/usr/bin/env bash
# A venv for eval/compare_tiny_turboquant.py: tiny-turboquant 0.18.0 (its TinyKVCache drop-in cache), installed
# without its dependencies so that it runs on the main venv's torch, transformers and numpy (seen through a .pth
# file, as scripts/turboquant_venv.sh does), and both sides run the same torch and model.
# Usage: bash scripts/tiny_turboquant_venv.sh [folder] [main venv]; then <folder>/bin/python eval/compare_tiny_turboquant.py
set -euo pipefail
venv="${1:-.venv-tiny-turboquant}"
main="${2:-.venv}"
"$main/bin/python" -m venv "$venv"
main_site="$("$main/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
venv_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import site; site.addsitedir('$main_site')" > "$venv_site/main_venv.pth"
"$venv/bin/pip" install -q --no-deps tiny-turboquant==0.18.0
"$venv/bin/python" -c "import importlib.metadata as m, tiny_turboquant, torch, transformers, hf_kvplus; print('tiny-turboquant', m.version('tiny-turboquant'), 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "tiny-turboquant venv ready: $venv/bin/python"
