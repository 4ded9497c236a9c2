#!/usr/bin/env bash
# One call on a lent GPU: the CUDA tests of the row-invariant forward, the CUDA graphs and the prefix
# cache, then the prefix-cache and decode (graphs vs eager) benchmarks at GLM-5.3 layer dimensions. Logs and JSON go to $OUT (the device tool's
# folder) or ./gpu_out. The copy on the GPU machine has no .git: pass the commit as the first argument.
#   bash bench/run_h200.sh <commit> [tests|tests-kernels|tests-engine|bench|all|depth|disk|moe-prefill|moe|exl3|batching]
# depth: the prefix cache (turns, one-word) and decode at GLM-5.3's 78 layers (4 distinct layers
# repeated, bench.lib.checkpoints.deepen); disk: the disk resume at 78 layers and at 4, each also
# from the page cache (both ~5 minutes); moe-prefill: the routed experts' sorted form against the
# loop (bench_moe_prefill, ~30 s); moe: the turns, the one-word extension and the disk resume with
# GLM-5.3's layer mix (a checkpoint of one dense and two MoE layers of 256 experts, 40 GB, run as
# 3 dense + 75 MoE layers; ~8 minutes); exl3: the packed-EXL3 kernels' GPU tests and bench_exl3_moe with
# exllamav3 1.6.5 side by side (carry .whl: tests/gpu/prepare_wheels.sh; exllamav3 compiles in the
# background, in its own session, while the kit's tests run; ~9 minutes); batching: 1, 4 and 16 decode
# streams through the batched runtime and a 19k prompt arriving beside 4 of them (bench_batching,
# GLM-5.3's layer dimensions, 4 layers; ~5 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
commit="${1:?usage: bash bench/run_h200.sh <commit> [tests|tests-kernels|tests-engine|bench|all|depth|disk|moe-prefill|moe|exl3|batching]}"
what="${2:-all}"
out="${OUT:-gpu_out}"
mkdir -p "$out"
export GLM53_KIT_COMMIT="$commit" PYTHONUNBUFFERED=1
status=0
# the engine's CUDA tests in two halves that each fit one device call (~10 minutes on a fresh machine,
# Triton compiling every kernel): tests-kernels, tests-engine; tests runs both
kernels=(tests/gpu/test_graph_replays_cuda.py tests/gpu/test_triton_cuda.py tests/gpu/test_select_topk_cuda.py)
engine=(tests/test_row_invariance.py tests/test_kv_cache_engine.py tests/test_drafter_glm53.py tests/test_serve_gpu.py)
gpu_tests() {  # name, files...: each test's result and the slowest durations in $out/gpu_<name>.log
    local name=$1; shift
    python3 -m pytest -v -m gpu -p no:cacheprovider --durations=20 "$@" 2>&1 | tee "$out/gpu_$name.log"
    status=$(( status | ${PIPESTATUS[0]} ))
}
case "$what" in
    tests|all) gpu_tests kernels "${kernels[@]}"; gpu_tests engine "${engine[@]}" ;;
    tests-kernels) gpu_tests kernels "${kernels[@]}" ;;
    tests-engine) gpu_tests engine "${engine[@]}" ;;
esac
if [ "$what" = bench ] || [ "$what" = all ]; then
    python3 -m bench.bench_prefix_cache --real-dims --device cuda --repeats 3 --profile \
        --out "$out/prefix_cache_h200.json" 2>&1 | tee "$out/prefix_cache_h200.log"
    status=$(( status | ${PIPESTATUS[0]} ))
    python3 -m bench.bench_decode_graphs --real-dims --out "$out/decode_graphs_h200.json" 2>&1 \
        | tee "$out/decode_graphs_h200.log"
    status=$(( status | ${PIPESTATUS[0]} ))
fi
if [ "$what" = depth ] || [ "$what" = disk ] || [ "$what" = batching ]; then  # one 4-layer checkpoint for every run below
    ckpt="$(mktemp -d)"
    python3 -m bench.lib.checkpoints "$ckpt" --layers 4 --vocab 32768
    real=(--real-dims --model-dir "$ckpt/real_dims" --device cuda)
fi
if [ "$what" = depth ]; then
    python3 -m bench.bench_prefix_cache "${real[@]}" --depth 78 --repeats 3 --scenarios turns one-word \
        --out "$out/prefix_cache_h200_depth78.json" 2>&1 | tee "$out/prefix_cache_h200_depth78.log"
    status=$(( status | ${PIPESTATUS[0]} ))
    python3 -m bench.bench_decode_graphs --real-dims --depth 78 --tokens 32 --repeats 2 \
        --out "$out/decode_graphs_h200_depth78.json" 2>&1 | tee "$out/decode_graphs_h200_depth78.log"
    status=$(( status | ${PIPESTATUS[0]} ))
fi
if [ "$what" = disk ]; then
    python3 -m bench.bench_prefix_cache "${real[@]}" --repeats 3 --scenarios disk \
        --out "$out/prefix_cache_h200_disk4.json" 2>&1 | tee "$out/prefix_cache_h200_disk4.log"
    status=$(( status | ${PIPESTATUS[0]} ))
    python3 -m bench.bench_prefix_cache "${real[@]}" --depth 78 --repeats 2 --scenarios disk \
        --out "$out/prefix_cache_h200_disk_depth78.json" 2>&1 | tee "$out/prefix_cache_h200_disk_depth78.log"
    status=$(( status | ${PIPESTATUS[0]} ))
fi
if [ "$what" = moe-prefill ]; then
    python3 -m bench.bench_moe_prefill --out "$out/moe_prefill_h200.json" 2>&1 | tee "$out/moe_prefill_h200.log"
    status=$(( status | ${PIPESTATUS[0]} ))
fi
if [ "$what" = moe ]; then
    ckpt="$(mktemp -d)"
    python3 -m bench.lib.checkpoints "$ckpt" --layers 3 --vocab 32768 --moe-experts 256 --dense-layers 1
    mix=(--real-dims --model-dir "$ckpt/real_dims" --device cuda --depth 78)
    python3 -m bench.bench_prefix_cache "${mix[@]}" --scenarios turns one-word --repeats 4 --off-repeats 1 \
        --out "$out/prefix_cache_h200_glm53mix.json" 2>&1 | tee "$out/prefix_cache_h200_glm53mix.log"
    status=$(( status | ${PIPESTATUS[0]} ))
    python3 -m bench.bench_prefix_cache "${mix[@]}" --scenarios disk --repeats 1 --page-cache-samples 2 \
        --out "$out/prefix_cache_h200_glm53mix_disk.json" 2>&1 | tee "$out/prefix_cache_h200_glm53mix_disk.log"
    status=$(( status | ${PIPESTATUS[0]} ))
fi
if [ "$what" = exl3 ]; then
    python3 -c "from bench.lib.exllamav3 import exllamav3_reference; \
exllamav3_reference().build_in_background('$out/exllamav3_build.log')"
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_exl3_cuda.py tests/gpu/test_exl3_engine_cuda.py 2>&1 | tee "$out/exl3_tests.log"
    status=$(( status | ${PIPESTATUS[0]} ))
    python3 -m bench.bench_exl3_moe --exllamav3 ${EXL3_BENCH_ARGS:-} --out "$out/exl3_moe_h200.json" 2>&1 \
        | tee "$out/exl3_moe_h200.log"
    status=$(( status | ${PIPESTATUS[0]} ))
fi
if [ "$what" = batching ]; then
    python3 -m bench.bench_batching --device cuda --model "$ckpt/real_dims" --streams 1,4,16 --tokens 64 \
        --repeats 3 --long-prompt 19000 --step-tokens 512 --out "$out/batching_h200.json" 2>&1 | tee "$out/batching_h200.log"
    status=$(( status | ${PIPESTATUS[0]} ))
fi
[ -n "${ckpt:-}" ] && rm -rf "$ckpt"
exit "$status"
