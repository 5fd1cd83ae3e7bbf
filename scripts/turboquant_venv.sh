#!/usr/bin/env bash
# A venv for eval/compare_turboquant.py's reference rows: turboquant-torch 0.4.0 imports scipy, which hf_kvplus
# keeps out of its own venv. The new venv holds only turboquant-torch and scipy and sees everything else (torch,
# transformers, numpy, hf_kvplus) in the main venv through a .pth file, so both sides run the same torch and model.
# Usage: bash scripts/turboquant_venv.sh [folder] [main venv]; then <folder>/bin/python eval/compare_turboquant.py
set -euo pipefail
venv="${1:-.venv-turboquant}"
main="${2:-.venv}"
"$main/bin/python" -m venv "$venv"
main_site="$("$main/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
venv_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import site; site.addsitedir('$main_site')" > "$venv_site/main_venv.pth"
"$venv/bin/pip" install -q --no-deps scipy turboquant-torch==0.4.0   # numpy comes from the main venv
"$venv/bin/python" -c "import turboquant, scipy, torch, transformers, hf_kvplus; print('turboquant', turboquant.__version__, 'scipy', scipy.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "turboquant venv ready: $venv/bin/python"
