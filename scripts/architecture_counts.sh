#!/usr/bin/env bash
# Before/after counts of the core's shape, read from the source (run at any commit):
#   bash scripts/architecture_counts.sh [ROOT]
set -euo pipefail
ROOT="${1:-$(dirname "${BASH_SOURCE[0]}")/..}"
cd "$ROOT"
ATTENTION_KERNELS=(kernels/decode_attention.py kernels/paged_attention.py kernels/quant_attention.py
    kernels/rotated_attention.py kernels/custom_ops.py kernels/quant_pack.py kernels/rotated_pack.py)
count() { grep -E "$1" "${@:2}" 2>/dev/null | wc -l; }
read_choices() {  # tests of the query count or the attention implementation inside storages' read methods
    awk '/^    def /{inread = ($0 ~ /def read\(/)} inread && /new (==|>|<=) 1|fused/' hf_kvplus/storage/*.py | wc -l
}
TOOLING=(hf_kvplus/evaluation hf_kvplus/cli hf_kvplus/resolve hf_kvplus/planning hf_kvplus/planner.py)
lines() { find "$@" -name '*.py' -print0 | xargs -0 cat | wc -l; }
EXCLUDE=()
for t in "${TOOLING[@]}"; do EXCLUDE+=(-not -path "$t*"); done
core=$(find hf_kvplus kernels -name '*.py' "${EXCLUDE[@]}" -print0 | xargs -0 cat | wc -l)
printf '%-58s %s\n' \
    "public kernel entry functions (attention, pack, ops)" "$(count '^def [a-z]' "${ATTENTION_KERNELS[@]}")" \
    "device choices in kernels/ (is_cuda / device.type tests)" "$(count 'is_cuda|device\.type ==|device\.type !=' kernels/*.py)" \
    "function-level project imports in kernels/" "$(count '^ +(from (\.|hf_kvplus)|import hf_kvplus)' kernels/*.py)" \
    "decode-vs-SDPA tests in storage reads (new ==/> 1, fused)" "$(read_choices)" \
    "storages told the attention implementation (fused=)" "$(count 'fused: bool|fused=' hf_kvplus/storage/*.py hf_kvplus/*.py)" \
    "quantized layouts (classes holding codes)" "$(count '^class (PackedSegment|QuantLayerPool|StaticQuantizedStorage|TokenQuantCodec|QuantoSegment|[A-Za-z]*Codes?)\b' hf_kvplus/storage/*.py hf_kvplus/paging/*.py)" \
    "code buffer layouts (files that allocate uint8 codes)" "$(grep -lE 'code_dim\(.*dtype=torch\.uint8' $(find hf_kvplus kernels -name '*.py') | wc -l)" \
    "is_compiling() calls in hf_kvplus/ and kernels/" "$(count 'is_compiling\(\)($|[^`])' $(find hf_kvplus kernels -name '*.py'))" \
    "lines in the core (hf_kvplus less tooling, kernels)" "$core" \
    "lines in tooling (evaluation, cli, resolve, planning)" "$(lines "${TOOLING[@]}")"
echo "longest files:"
find hf_kvplus kernels -name '*.py' -print0 | xargs -0 wc -l | sort -n | grep -v total | tail -3
