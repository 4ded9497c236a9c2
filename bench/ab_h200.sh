#!/usr/bin/env bash
# Two kit versions side by side on one lent GPU: the prefix-cache bench at GLM-5.3's 78 layers (4
# distinct layers repeated) on one checkpoint, the old checkout then this one, each its own process.
#   [REPEATS=N] [OFF_REPEATS=M] [TURN_GAP=S] [DEPTH=L] bash bench/ab_h200.sh <old_dir> <old_commit> <new_commit> [scenario ...]
# (default scenario: turns; OFF_REPEATS: turns with cache off in the first M repeats only, so more
# cache-on samples fit in the same time; TURN_GAP: seconds idle after each turn; both need an old
# checkout whose bench has --off-repeats / --turn-gap; DEPTH: layers run, default 78, 4 = the checkpoint's own)
# old_dir: e.g. `git archive <old_commit> | tar -x -C ab_old` (carried to the GPU machine); the copies
# there have no .git, hence the commits. Logs and JSON to $OUT (or ./gpu_out) as <scenario>_{old,new}.*
set -uo pipefail
cd "$(dirname "$0")/.."
old_dir="${1:?usage: bash bench/ab_h200.sh <old_dir> <old_commit> <new_commit> [scenario ...]}"
old_commit="${2:?old commit}"
new_commit="${3:?new commit}"
shift 3
scenarios=("${@:-turns}")
out="$(realpath -m "${OUT:-gpu_out}")"
mkdir -p "$out"
[ -f "$old_dir/bench/bench_prefix_cache.py" ] || { echo "error: $old_dir holds no kit checkout" >&2; exit 2; }
export PYTHONUNBUFFERED=1
ckpt="$(mktemp -d)"
trap 'rm -rf "$ckpt"' EXIT
python3 -m bench.lib.checkpoints "$ckpt" --layers 4 --vocab 32768 > "$out/ab_checkpoint.log" 2>&1 || { echo "error: checkpoint failed, see $out/ab_checkpoint.log" >&2; exit 1; }
status=0
for scenario in "${scenarios[@]}"; do
    repeats="${REPEATS:-3}"
    [ "$scenario" = one-word ] && repeats="${REPEATS:-6}"
    for arm in old new; do
        dir=.; commit="$new_commit"
        [ "$arm" = old ] && { dir="$old_dir"; commit="$old_commit"; }
        echo "== $scenario, $arm ($commit)" >&2
        (cd "$dir" && GLM53_KIT_COMMIT="$commit" python3 -m bench.bench_prefix_cache --real-dims \
            --model-dir "$ckpt/real_dims" --device cuda --depth "${DEPTH:-78}" --repeats "$repeats" --scenarios "$scenario" \
            ${OFF_REPEATS:+--off-repeats "$OFF_REPEATS"} ${TURN_GAP:+--turn-gap "$TURN_GAP"} \
            --out "$out/${scenario}_$arm.json" > "$out/${scenario}_$arm.log" 2>&1)
        status=$(( status | $? ))
        tail -4 "$out/${scenario}_$arm.log"
    done
done
exit "$status"
