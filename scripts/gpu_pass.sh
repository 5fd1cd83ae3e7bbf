#!/usr/bin/env bash
# One command for a lent GPU: the environment and its ceilings, the test suite on CUDA, the kernels
# compiled ahead of time, and every GPU benchmark in eval/, merged into one JSON and one Markdown file.
#
#   bash scripts/gpu_pass.sh [--dry-run] [--out DIR] [STEP[:LIMIT]...]
#
# Steps (default: all, in this order; time limit of each in seconds on a GPU, which STEP:LIMIT replaces):
#   env 60 | tests 330 | aot 180 | kernels 240 | e2e-b1 210 | e2e-b8 270 | offload 210 | compile 480
#   (33 minutes in all). Two shares of `tests` for a short lease, not in the default list:
#   tests-syncs 120 (no decode step of any cache synchronizes; test_decode_syncs.py, test_cuda_paths.py)
#   and tests-kernels 240 (the kernel tests alone); and two of `compile`: compile-b1 and compile-b8 300 each (one
#   batch size; results in DIR/compile-b1/, DIR/compile-b8/). A session with one 10-minute call runs, for example:
#   bash scripts/gpu_pass.sh tests-syncs:55 tests-kernels:75 compile-b1:300   (the whole compile step needs more than one call)
# The device tool runs one command for at most 10 minutes, so on a lent GPU run it in four calls
# (each call's results come back in $OUT; merge them here with eval/gpu_pass_report.py):
#   bash scripts/gpu_pass.sh env tests aot
#   bash scripts/gpu_pass.sh kernels e2e-b1
#   bash scripts/gpu_pass.sh e2e-b8 offload
#   bash scripts/gpu_pass.sh compile
# Results: DIR/gpu_pass.json, DIR/gpu_pass.md, each step's log and files (DIR defaults to gpu-pass/);
# where $OUT is set (the device tool), those two files, the tests' log and a tarball of DIR go there.
# Publishing a pass: copy DIR into eval/results/<experiment>/ (the latest run only), then rerun
# `python eval/report.py`, which rewrites BENCHMARKS.md from the JSON (CI checks it with --check).
# --dry-run runs every step on the CPU at tiny sizes (CI does, so the pass cannot rot between GPUs).
# On the GPU image nothing is fetched: hf_kvplus is installed from this checkout without dependencies,
# and wheels in .whl/ (made here by scripts/gpu_wheels.sh) are installed first if present.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DRY=""
DIR=gpu-pass
STEPS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=--dry-run ;;
        --out) DIR="$2"; shift ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        *) STEPS+=("$1") ;;
    esac
    shift
done
[ ${#STEPS[@]} -eq 0 ] && STEPS=(env tests aot kernels e2e-b1 e2e-b8 offload compile)
mkdir -p "$DIR"
export PYTHONUNBUFFERED=1

# The tests the CUDA run selects: every kernel test, the storage and cache tests, and a fast subset of
# the conformance suite (two architectures, five generate modes, every cache).
CUDA_TESTS=(
    tests/test_kernel_decode_attention.py tests/test_kernel_paged_attention.py
    tests/test_kernel_quant_attention.py tests/test_kernel_quant_pack.py tests/test_kernel_attention_mass.py
    tests/test_cuda_paths.py tests/test_cache_dtypes.py tests/test_dense_storage.py tests/test_quantized_storage.py tests/test_layer.py
    tests/test_attention_path.py tests/test_quantized_cache.py tests/test_paged_cache.py
    tests/test_paged_quantized.py tests/test_evicting_cache.py tests/test_eviction_policies.py
    tests/test_offloaded_stateful.py tests/test_compile_generate.py
)
CONFORMANCE_SUBSET="(llama or gemma3) and (greedy or beam or left_padded or assisted or manual)"
SYNC_TESTS=(tests/test_decode_syncs.py tests/test_cuda_paths.py)
KERNEL_TESTS=(tests/test_kernel_decode_attention.py tests/test_kernel_paged_attention.py
    tests/test_kernel_quant_attention.py tests/test_kernel_quant_pack.py tests/test_kernel_attention_mass.py
    tests/test_rotated_kernels.py)

if [ -n "$DRY" ]; then
    PY="${KVPLUS_VENV:-.venv}/bin/python"
    [ -x "$PY" ] || PY=python3
    PARALLEL=()
else
    PY=python3
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvplus-site .whl/*.whl \
            && export PYTHONPATH="/tmp/kvplus-site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if ! "$PY" -c "import hf_kvplus" 2>/dev/null \
        && ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
        # No usable build backend there: the package as links (kernels/ is hf_kvplus.kernels), first on the path.
        mkdir -p /tmp/kvplus-src/hf_kvplus
        for entry in hf_kvplus/*; do ln -sfn "$PWD/$entry" "/tmp/kvplus-src/$entry"; done
        ln -sfn "$PWD/kernels" /tmp/kvplus-src/hf_kvplus/kernels
        export PYTHONPATH="/tmp/kvplus-src${PYTHONPATH:+:$PYTHONPATH}"
        "$PY" -c "import hf_kvplus" || exit 1
    fi
    PARALLEL=(-n 8)  # pytest-xdist: Triton compiles run in parallel
fi

run_step() {  # name, time limit (s), command...
    local name=$1 limit=$2 start rc
    shift 2
    # The limits are a GPU lease's; a dry run on a loaded CI machine gets five times as long (the env step, 6 s
    # alone, once ran past its 60 s beside the suite's other worker and the other builds of a shared 2-core VM).
    [ -n "$DRY" ] && limit=$(( limit * 5 ))
    start=$(date +%s)
    echo "== $name (limit ${limit}s)"
    if declare -F "$1" >/dev/null; then  # a function of this script: timeout needs a process, so a bash that has it
        timeout "$limit" bash -c "$(declare -p PY DRY DIR CUDA_TESTS SYNC_TESTS KERNEL_TESTS PARALLEL CONFORMANCE_SUBSET); \
            $(declare -f pytest_run tests_step syncs_step kernel_tests_step aot_step); $*" >"$DIR/$name.log" 2>&1
    else
        timeout "$limit" "$@" >"$DIR/$name.log" 2>&1
    fi
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$limit" >>"$DIR/steps.tsv"
    echo "   rc=$rc, $(( $(date +%s) - start )) s; last lines:"
    grep -v '%|' "$DIR/$name.log" | tail -n 4 | sed 's/^/   /'
}

pytest_run() {  # junit file, -k expression, dry-run -k expression, files...
    local junit=$1 select=$2 dry_select=$3
    shift 3
    if [ -n "$DRY" ]; then  # CI runs the whole suite on the CPU; here a few tests, to check the step itself: every
        # file it names is there, and the files that hold the dry selection's tests run (each file collected costs
        # seconds of imports on the CPU)
        local file missing=() words=() held=()
        for file in "$@"; do [ -f "$file" ] || missing+=("$file"); done
        [ ${#missing[@]} -eq 0 ] || { echo "the step names test files that are not there: ${missing[*]}"; return 1; }
        for file in $(grep -oE '[A-Za-z_][A-Za-z0-9_]*' <<<"$dry_select" | grep -vxE 'and|or|not'); do words+=(-e "$file"); done
        for file in "$@"; do grep -qF "${words[@]}" "$file" && held+=("$file"); done
        [ ${#held[@]} -gt 0 ] || { echo "no test file the step names holds a test of \"$dry_select\""; return 1; }
        "$PY" -m pytest -p no:cacheprovider --device cpu -q --junitxml "$junit" -k "${select:+($select) and }($dry_select)" "${held[@]}"
    else
        # -v: each result is in the log as it comes, so a step cut at its limit still says what passed
        "$PY" -m pytest -p no:cacheprovider --device cuda -v -rfE "${PARALLEL[@]}" --junitxml "$junit" ${select:+-k "$select"} "$@"
    fi
}

tests_step() {
    local rc=0
    pytest_run "$DIR/tests.xml" "" "pick_num_splits or never_waits" "${CUDA_TESTS[@]}" || rc=1
    pytest_run "$DIR/tests_conformance.xml" "$CONFORMANCE_SUBSET" "dense and greedy" tests/test_conformance.py || rc=1
    return $rc
}

syncs_step() { pytest_run "$DIR/tests-syncs.xml" "" "cuda or never_waits" "${SYNC_TESTS[@]}"; }

kernel_tests_step() { pytest_run "$DIR/tests-kernels.xml" "" "pick_num_splits" "${KERNEL_TESTS[@]}"; }

aot_step() {  # the full set for the GPU's own architecture; a dry run compiles one kernel's covering subset in one
    # process (the suite's test_kernels_aot.py compiles every kernel's)
    if [ -n "$DRY" ]; then
        "$PY" -m hf_kvplus.kernels.aot --arch sm_90 --quick --kernel _paged_store_kernel --jobs 1 --json "$DIR/aot.json"
    else
        "$PY" -m hf_kvplus.kernels.aot --json "$DIR/aot.json" \
            --arch "$("$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'sm_{p.major}{p.minor}')")"
    fi
}

for entry in "${STEPS[@]}"; do
    step=${entry%%:*}
    limit=""
    [ "$entry" != "$step" ] && limit=${entry#*:}
    case "$step" in
        env) run_step env "${limit:-60}" "$PY" eval/gpu_env.py --out "$DIR" $DRY ;;
        tests) run_step tests "${limit:-330}" tests_step ;;
        tests-syncs) run_step tests-syncs "${limit:-120}" syncs_step ;;
        tests-kernels) run_step tests-kernels "${limit:-240}" kernel_tests_step ;;
        aot) run_step aot "${limit:-180}" aot_step ;;
        kernels) run_step kernels "${limit:-240}" "$PY" eval/bench_kernels_gpu.py --out "$DIR" $DRY ;;
        e2e-b1) run_step e2e-b1 "${limit:-210}" "$PY" eval/bench_e2e_gpu.py --out "$DIR" --batch 1 $DRY ;;
        e2e-b8) run_step e2e-b8 "${limit:-270}" "$PY" eval/bench_e2e_gpu.py --out "$DIR" --batch 8 $DRY ;;
        offload) run_step offload "${limit:-210}" "$PY" eval/bench_offload_gpu.py --out "$DIR" --batch 1 4 $DRY ;;
        compile) run_step compile "${limit:-480}" "$PY" eval/bench_compile.py --out "$DIR" --gpu-pass $DRY ;;
        compile-b1|compile-b8) run_step "$step" "${limit:-300}" "$PY" eval/bench_compile.py --out "$DIR/$step" --gpu-pass \
            --batch "${step#compile-b}" $DRY ;;
        *) echo "unknown step: $step (steps: env tests tests-syncs tests-kernels aot kernels e2e-b1 e2e-b8 offload" \
            "compile compile-b1 compile-b8)" >&2; exit 2 ;;
    esac
done

"$PY" eval/gpu_pass_report.py "$DIR" --out "$DIR"
status=$?
if [ -n "${OUT:-}" ]; then
    cp "$DIR/gpu_pass.json" "$DIR/gpu_pass.md" "$OUT/" 2>/dev/null
    for log in "$DIR"/tests*.log; do [ -f "$log" ] && cp "$log" "$OUT/"; done
    tar czf "$OUT/gpu-pass.tgz" -C "$DIR" .
fi
exit $status
