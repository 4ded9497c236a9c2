"""Restoring cached rows into a fresh KV cache: growing it as blocks arrive against reserving the
prompt's room first (what Glm53Engine._state_for does before a restore), side by side.

    python -m bench.bench_restore                 # CPU: 8192 positions x 78 layers at GLM-5.3 dims
    python -m bench.bench_restore --device cuda --positions 94000

Rows as the prefix cache holds them (blocks of 256 positions, bf16 latents on every layer, indexer
keys on every other), each arm importing them block by block with `KVState.import_rows` into a new
state, arms alternating, wall time (device synchronized), median of --repeats. Both arms must end
with the same rows (exit 1 otherwise). Prints a table; JSON (bench/lib/meta.py header) to --out.
Exit codes: 0 done, 1 rows differ, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.lib.kvstate import new_kv_state
from bench.lib.meta import RESULTS, result_header
from glm53.measurement import summary, write_json
from glm53.model.kv_state import KVState

BLOCK = 256


def restore(blocks: list[tuple[int, dict]], positions: int, layers: int, device: str,
            reserve_first: bool) -> tuple[float, KVState]:
    state = new_kv_state(layers, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    if reserve_first:
        state.reserve(positions + 1)  # the prompt: the restored rows and the token after them
    for start, rows in blocks:
        n = next(iter(rows.values())).shape[0]
        state.import_rows(start, rows, list(range(start, start + n)))
    sync()
    return time.perf_counter() - t0, state


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--positions", type=int, default=8192)
    p.add_argument("--layers", type=int, default=78)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--out", type=Path, default=RESULTS / "restore.json")
    args = p.parse_args()
    if min(args.positions, args.layers, args.repeats) <= 0:
        print("error: --positions, --layers and --repeats must be positive", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(3)
    source = new_kv_state(args.layers, "cpu")
    source.reserve(args.positions)
    for i in range(args.layers):
        source.write_latent(i, 0, torch.randn(args.positions, 576, generator=g))
    source.tokens.extend(range(args.positions))
    # host-tier nodes: each block's rows in storage of its own
    blocks = [(a, {k: v.clone() for k, v in source.export_rows(a, min(a + BLOCK, args.positions)).items()})
              for a in range(0, args.positions, BLOCK)]
    arms = {"grow_per_block": False, "reserve_first": True}
    times: dict[str, list[float]] = {name: [] for name in arms}
    same = True
    for i in range(args.repeats):
        ends = {}
        for name in (list(arms) if i % 2 == 0 else list(reversed(arms))):
            dt, ends[name] = restore(blocks, args.positions, args.layers, args.device, arms[name])
            times[name].append(dt)
        a, b = (ends[name].export_rows(0, args.positions) for name in arms)
        same &= all(torch.equal(a[k], b[k]) for k in a)
        print(f"sample {i}: " + ", ".join(f"{name} {times[name][-1]:.3f}s" for name in arms), file=sys.stderr, flush=True)
    mib = args.positions * source.position_bytes() / 2**20
    settings = {"positions": args.positions, "layers": args.layers, "block": BLOCK, "repeats": args.repeats,
                "mib": mib, "timing": "wall of the restore, device synchronized, arms alternating"}
    result = {**result_header("restore", settings, device=args.device),
              **{f"{name}_s": summary(times[name]) for name in arms}, "same_rows": same}
    result["speedup"] = result["grow_per_block_s"]["median"] / result["reserve_first_s"]["median"]
    write_json(args.out, result)
    print(f"restore of {args.positions} positions x {args.layers} layers ({mib:.0f} MiB) on {args.device}: "
          f"growing per block {statistics.median(times['grow_per_block']):.3f} s, reserved first "
          f"{statistics.median(times['reserve_first']):.3f} s = {result['speedup']:.2f}x; same rows: {same}")
    print(f"full results: {args.out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
