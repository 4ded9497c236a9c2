#!/usr/bin/env bash
# One call on a lent GPU: the CUDA tests of the row-invariant forward, the CUDA graphs and the prefix
# cache, then the prefix-cache and decode (graphs vs eager) benchmarks at GLM-5.3 layer dimensions. Logs and JSON go to $OUT (the device tool's
# folder) or ./gpu_out. The copy on the GPU machine has no .git: pass the commit as the first argument.
#   bash bench/run_h200.sh <commit> [tests|tests-kernels|tests-engine|bench|all|depth|disk|moe-prefill|moe|exl3|exl3-profile|batching|api]
# depth: the prefix cache (turns, one-word) and decode at GLM-5.3's 78 layers (4 distinct layers
# repeated, bench.lib.checkpoints.deepen); disk: the disk resume at 78 layers and at 4, each also
# from the page cache (both ~5 minutes); moe-prefill: the routed experts' sorted form against the
# loop (bench_moe_prefill, ~30 s); moe: the turns, the one-word extension and the disk resume with
# GLM-5.3's layer mix (a checkpoint of one dense and two MoE layers of 256 experts, 40 GB, run as
# 3 dense + 75 MoE layers; ~8 minutes); exl3: the packed-EXL3 kernels' GPU tests and bench_exl3_moe with
# exllamav3 1.6.5 side by side (carry .whl: tests/gpu/prepare_wheels.sh; exllamav3 compiles in the
# background, in its own session, while the kit's tests run; ~9 minutes); exl3-profile: each decode
# form's kernel times (torch.profiler) and Nsight Compute's view of the CUDA split sums (~4 minutes); batching: 1, 4 and 16 decode
# streams through the batched runtime and a 19k prompt arriving beside 4 of them (bench_batching,
# GLM-5.3's layer dimensions, 4 layers, 128 rows a step (the default where pieces replay graphs), then a round each with its steps split by --profile and one under torch.profiler, --kernels; then the long prompt at 256 rows a step; ~8 minutes); api: glm53-bench's four suites through the kit's
# lane on the GPU (serve.sh --local, a 4-layer checkpoint at GLM-5.3's layer dimensions with the tiny
# tokenizer, and a second lane with its prefix cache off for the agent suite's cache-off column), JSON,
# tables and plots as $out/api_bench_<device>.* (carry .whl: tests/gpu/prepare_front_wheels.sh; the mode
# installs them into /tmp/site; ~5-8 minutes, the bench interrupted at API_DEADLINE_S, default 480 s from
# the mode's start, keeping the suites done). API_MODEL (a checkpoint to serve instead), API_BENCH_ARGS
# (the bench's sizes), API_NO_CACHE_LANE=0 (one lane: the bench's unique-first-line fallback), API_PORT
# (8300; the cache-off lane one above) and API_WHEELS (.whl/front; empty: python3 has the packages) change
# it; the lanes' logs go to $out/api_<device>_lanes.log when anything fails.
set -uo pipefail
cd "$(dirname "$0")/.."
commit="${1:?usage: bash bench/run_h200.sh <commit> [tests|tests-kernels|tests-engine|bench|all|depth|disk|moe-prefill|moe|exl3|exl3-profile|batching|api]}"
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
if [ "$what" = exl3-profile ]; then  # where the CUDA split sums' time goes: kernel times, then Nsight Compute
    python3 -m bench.bench_exl3_moe --tokens 1 4 --prefill --kernel-times --out "$out/exl3_kernel_times.json" 2>&1 \
        | tee "$out/exl3_kernel_times.log"
    status=$(( status | ${PIPESTATUS[0]} ))
    ncu --kernel-name regex:exl3_parts --launch-skip 8 --launch-count 2 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        python3 -m bench.bench_exl3_moe --tokens 1 --sets 2 --reps 2 --prefill --out /tmp/exl3_ncu.json \
        > "$out/exl3_parts_ncu.txt" 2>&1
    status=$(( status | $? ))
fi
if [ "$what" = batching ]; then
    python3 -m bench.bench_batching --device cuda --model "$ckpt/real_dims" --streams 1,4,16 --tokens 64 \
        --repeats 3 --long-prompt 19000 --step-tokens 128 --profile --kernels --out "$out/batching_h200.json" 2>&1 | tee "$out/batching_h200.log"
    status=$(( status | ${PIPESTATUS[0]} ))
    # the long prompt's pieces at twice the default budget (docs/decisions/step-budget.md: the 3x goal)
    python3 -m bench.bench_batching --device cuda --model "$ckpt/real_dims" --streams 4 --tokens 64 --repeats 3 \
        --long-prompt 19000 --step-tokens 256 --kernels --out "$out/batching_h200_step256.json" 2>&1 | tee "$out/batching_h200_step256.log"
    status=$(( status | ${PIPESTATUS[0]} ))
fi
if [ "$what" = api ]; then
    api_t0=$SECONDS
    dev=$(nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
    alog="$out/api_$dev.log"
    say() { echo "[api $((SECONDS - api_t0))s] $*" | tee -a "$alog"; }
    gpu_memory() { nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"; }
    py="$(command -v python3)"  # the lanes run with it (serve.sh takes a path, not a name)
    say "python3 is $py; $(gpu_memory)"
    wheels=${API_WHEELS-.whl/front}
    if [ -n "$wheels" ]; then
        python3 tests/gpu/install_front_wheels.py --wheels "$wheels" --target /tmp/site 2>&1 | tee -a "$alog"
        [ "${PIPESTATUS[0]}" = 0 ] || { say "the front's wheels are not all there: see above"; exit 1; }
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    model="${API_MODEL:-}"
    label="kit lane, $(basename "${model:-x}")"
    if [ -z "$model" ]; then
        label="kit lane, 4 layers at GLM-5.3's dimensions (random bf16 weights, tiny tokenizer)"
        ckpt="$(mktemp -d)"
        python3 -m bench.lib.checkpoints "$ckpt" --layers 4 --vocab 32768 --tokenizer >> "$alog" 2>&1 \
            || { say "writing the checkpoint failed: see above"; rm -rf "$ckpt"; exit 1; }
        model="$ckpt/real_dims"
        say "checkpoint $model written ($(du -sh "$model" | cut -f1))"
    fi
    port=${API_PORT:-8300}
    ports=("$port")
    [ "${API_NO_CACHE_LANE:-1}" = 1 ] && ports+=("$((port + 1))")
    stop_lanes() {
        for p in "${ports[@]}"; do GLM53_PYTHON="$py" bash serve.sh stop --port "$p" >> "$alog" 2>&1 & done
        wait
    }
    trap stop_lanes EXIT
    starting="$(mktemp -d)"
    declare -A starter
    for p in "${ports[@]}"; do  # at once: each plans against the GPU's free memory, both fit beside each other
        cache=$([ "$p" = "$port" ] && echo 1 || echo 0)
        TF_GLM53_PREFIX_CACHE=$cache GLM53_PYTHON="$py" bash serve.sh --local --model "$model" --port "$p" \
            > "$starting/$p.log" 2>&1 &
        starter[$p]=$!
    done
    up=()
    for p in "${ports[@]}"; do
        wait "${starter[$p]}"; rc=$?
        cat "$starting/$p.log" >> "$alog"
        if [ "$rc" = 0 ]; then up+=("$p"); say "lane $p READY"; else say "lane $p failed to start (exit $rc)"; status=1; fi
    done
    rm -rf "$starting"
    bench=(--suites decode,agent,extend,concurrency --ignore-eos)
    if [ "${#ports[@]}" = 2 ] && [ "${#up[@]}" = 2 ]; then
        bench+=(--no-cache-url "http://127.0.0.1:$((port + 1))")
    elif [ "${up[0]:-}" = "$port" ]; then
        say "one lane: the agent suite's cache-off requests each open with their own first line"
    fi
    if [ "${up[0]:-}" = "$port" ]; then
        say "$(gpu_memory) with the lanes loaded"
        # the issue's sizes, with fewer repeats of the agent conversation, the extension and the client rounds
        sizes=${API_BENCH_ARGS:-"--samples 6 --decode-tokens 320 --agent-turns 6 --agent-turn-tokens 2700 \
--agent-samples 2 --extend-tokens 19000 --extend-samples 2 --concurrency 1,2,4,8,16 --concurrency-tokens 128 \
--concurrency-rounds 1"}
        left=$(( ${API_DEADLINE_S:-480} - (SECONDS - api_t0) ))
        [ "$left" -ge 30 ] || left=30
        say "glm53-bench ${bench[*]} $sizes (interrupted after $left s)"
        # SIGINT at the deadline, which the bench answers by saving what it measured (timeout hands it SIGINT
        # unignored also where a shell runs this in the background)
        # shellcheck disable=SC2086  # the sizes are words
        timeout --preserve-status -s INT -k 20 "$left" python3 -m glm53.apibench --url "http://127.0.0.1:$port" \
            "${bench[@]}" $sizes --label "$label, $(gpu_memory | cut -d, -f1)" \
            --out "$out/api_bench_$dev.json" 2>&1 | tee -a "$alog"
        rc=${PIPESTATUS[0]}
        say "glm53-bench exit $rc$([ "$rc" = 130 ] && echo ': interrupted at the deadline; the JSON keeps the suites done')"
        [ "$rc" = 0 ] || status=1
        say "$(gpu_memory) after the bench"
    fi
    stop_lanes
    trap - EXIT
    if [ "$status" != 0 ]; then  # the lanes' logs (kept in .work/lanes/PORT/), their last lines, in one file
        for p in "${ports[@]}"; do
            for f in .work/lanes/"$p"/supervisor.log .work/lanes/"$p"/rank*.log; do
                [ -f "$f" ] && { echo "=== $f (last 300 lines)"; tail -n 300 "$f"; }
            done
        done > "$out/api_${dev}_lanes.log"
    fi
    say "done (status $status)"
fi
[ -n "${ckpt:-}" ] && rm -rf "$ckpt"
exit "$status"
