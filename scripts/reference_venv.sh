#!/usr/bin/env bash
# A venv for a reference library the comparisons run beside hf_kvplus, holding only that library (installed without
# its dependencies) and seeing everything else (torch, transformers, numpy, hf_kvplus) in the main venv through a
# .pth file, so that both sides run the same torch and model:
#   turboquant       turboquant-torch 0.4.0 and scipy (which hf_kvplus keeps out of its venv): eval/compare_turboquant.py
#   tiny-turboquant  tiny-turboquant 0.18.0 (its TinyKVCache drop-in cache): eval/compare_tiny_turboquant.py
# Usage: bash scripts/reference_venv.sh LIBRARY [folder] [main venv]; then <folder>/bin/python eval/compare_...py
# (kvpress needs an older transformers than hf_kvplus's: scripts/kvpress_venv.sh makes a venv of its own.)
set -euo pipefail
library="${1:?give the library: turboquant or tiny-turboquant}"
case "$library" in
    turboquant) packages=(scipy turboquant-torch==0.4.0); module=turboquant; dist=turboquant-torch ;;
    tiny-turboquant) packages=(tiny-turboquant==0.18.0); module=tiny_turboquant; dist=tiny-turboquant ;;
    *) echo "unknown library '$library': turboquant or tiny-turboquant" >&2; exit 2 ;;
esac
venv="${2:-.venv-$library}"
main="${3:-.venv}"
"$main/bin/python" -m venv "$venv"
main_site="$("$main/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
venv_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import site; site.addsitedir('$main_site')" > "$venv_site/main_venv.pth"
"$venv/bin/pip" install -q --no-deps "${packages[@]}"   # numpy and the rest come from the main venv
"$venv/bin/python" -c "import importlib.metadata as m, $module, torch, transformers, hf_kvplus; print('$dist', m.version('$dist'), 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "$library venv ready: $venv/bin/python"
