#!/usr/bin/env bash
# One lent-GPU session: the CUDA tests of the row-invariant forward, the CUDA graphs and the prefix
# cache, then the prefix-cache and decode (graphs vs eager) benchmarks at GLM-5.3 layer dimensions. Logs and JSON go to $OUT (the device tool's
# folder) or ./gpu_out. The copy on the GPU machine has no .git: pass the commit as the first argument.
#   bash bench/run_h200.sh <commit> [tests|bench|all]
set -uo pipefail
cd "$(dirname "$0")/.."
commit="${1:?usage: bash bench/run_h200.sh <commit> [tests|bench|all]}"
what="${2:-all}"
out="${OUT:-gpu_out}"
mkdir -p "$out"
export GLM53_KIT_COMMIT="$commit" PYTHONUNBUFFERED=1
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_graph_replays_cuda.py tests/gpu/test_triton_cuda.py \
        tests/test_row_invariance.py tests/test_kv_cache_engine.py tests/test_drafter_glm53.py tests/test_serve_gpu.py \
        2>&1 | tee "$out/gpu_tests.log"
    status=$(( status | ${PIPESTATUS[0]} ))
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    python3 bench/bench_prefix_cache.py --real-dims --device cuda --repeats 3 --profile \
        --out "$out/prefix_cache_h200.json" 2>&1 | tee "$out/prefix_cache_h200.log"
    status=$(( status | ${PIPESTATUS[0]} ))
    python3 bench/bench_decode_graphs.py --real-dims --out "$out/decode_graphs_h200.json" 2>&1 \
        | tee "$out/decode_graphs_h200.log"
    status=$(( status | ${PIPESTATUS[0]} ))
fi
exit "$status"
