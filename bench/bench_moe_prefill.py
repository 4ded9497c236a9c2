"""One MoE layer's routed experts over a prefill piece: the per-expert loop against the sorted form
(one grouped launch per projection, no host sync), side by side, bit for bit.

    python -m bench.bench_moe_prefill --out bench/results/moe_prefill_h200.json     # GPU

GLM-5.3's bank by default (256 experts of width 2048 over hidden 6144, top 8, bf16 as the engine
holds them after decoding EXL3: 19 GB), random routing, T tokens a piece (default 2048, 2700 and
8192: whether a piece reads the bank's 19 GB faster than it computes, so that longer pieces would
cost less a token, is the time per token across them). The sorted form runs once per --row-tiles
value, with linear's tile for that many rows (64: the 64x64 mid tile; 2048: the 128x128 prefill tile, the engine's GROUPED_ROWS, which reads each expert's matrix
once for up to 128 rows instead of 64).
Time: wall clock of the call with the device synchronised before and after (the loop is bound by
its launches and its host sync, so events alone would miss its host time); arms alternate, the
first call of each discarded, median with min and max.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.lib.meta import RESULTS, result_header
from glm53.measurement import write_json


def timed(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def run(experts: int, hidden: int, width: int, top_k: int, tokens: list[int], repeats: int,
        row_tiles: list[int]) -> list[dict[str, Any]]:
    from glm53.model.moe import DecodedExperts
    from glm53.ops import triton_linear

    g = torch.Generator(device="cuda").manual_seed(2026)
    gate_up = torch.empty(experts, 2 * width, hidden, dtype=torch.bfloat16, device="cuda")
    down = torch.empty(experts, hidden, width, dtype=torch.bfloat16, device="cuda")
    for e in range(experts):  # one expert at a time: no fp32 copy of the whole bank
        gate_up[e] = torch.randn(2 * width, hidden, generator=g, device="cuda") * hidden ** -0.5
        down[e] = torch.randn(hidden, width, generator=g, device="cuda") * width ** -0.5
    bank = DecodedExperts(gate_up, down)
    default_rows = triton_linear.GROUPED_ROWS
    agrees = {}
    for r in row_tiles:  # the engine's device check, per tile (once per shape)
        triton_linear.GROUPED_ROWS = r
        agrees[r] = triton_linear.grouped_agrees(gate_up) and triton_linear.grouped_agrees(down)
    rows = []
    for t in tokens:
        x = torch.randn(t, hidden, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.rand(t, experts, generator=g, device="cuda").topk(top_k, dim=1).indices
        weights = torch.rand(t, top_k, generator=g, device="cuda")

        def sorted_at(tile_rows: int) -> Callable[[], torch.Tensor]:
            def call() -> torch.Tensor:  # the grouped form with linear's tile for tile_rows rows
                triton_linear.GROUPED_ROWS = tile_rows
                return bank.runs(x, ids, weights)
            return call

        arms = {"loop": lambda: bank.by_expert(x, ids, weights),
                **{f"sorted_{r}": sorted_at(r) for r in row_tiles}}
        samples: dict[str, list[float]] = {name: [] for name in arms}
        outs: dict[str, torch.Tensor] = {}
        for i in range(repeats + 1):
            for name, fn in arms.items():
                s, outs[name] = timed(fn)
                if i:
                    samples[name].append(s)
        same = {name: bool(torch.equal(outs["loop"], out)) for name, out in outs.items() if name != "loop"}
        row = {"tokens": t, "grouped_agrees": agrees, "bitwise_equal": all(same.values()), "bitwise_by_arm": same}
        for name, s in samples.items():
            row[name] = {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s), "samples_s": s}
        rows.append(row)
        print(f"T {t}: " + ", ".join(f"{name} {row[name]['median_s'] * 1e3:.2f} ms" for name in arms)
              + f"; bitwise {same}, device check {agrees}", flush=True)
    triton_linear.GROUPED_ROWS = default_rows
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 2700, 8192])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--row-tiles", type=int, nargs="+", default=[64, 2048],
                    help="the sorted form's arms: each with linear's tile for this many rows (64: the mid "
                         "tile 64x64; 2048: the prefill tile 128x128)")
    ap.add_argument("--out", type=Path, default=RESULTS / "moe_prefill.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_moe_prefill: needs a CUDA device", file=sys.stderr)
        return 2
    if min(args.experts, args.hidden, args.width, args.top_k, args.repeats, *args.tokens, *args.row_tiles) <= 0 \
            or args.top_k > args.experts:
        print("error: every size must be positive and --top-k at most --experts", file=sys.stderr)
        return 2
    result = result_header("bench_moe_prefill", {"experts": args.experts, "hidden": args.hidden, "width": args.width,
                                                 "top_k": args.top_k, "tokens": args.tokens, "repeats": args.repeats,
                                                 "row_tiles": args.row_tiles,
                                                 "dtype": "bfloat16", "routing": "random top-k"}, torch.device("cuda"))
    result["rows"] = run(args.experts, args.hidden, args.width, args.top_k, args.tokens, args.repeats, args.row_tiles)
    print("tokens | arm | median (ms) | us a token | loop / arm | bitwise with the loop")
    for r in result["rows"]:
        for name in ["loop"] + [f"sorted_{t}" for t in args.row_tiles]:
            ms = r[name]["median_s"]
            print(f"{r['tokens']:6d} | {name:11s} | {ms * 1e3:11.2f} | {ms * 1e6 / r['tokens']:10.2f} | "
                  f"{r['loop']['median_s'] / ms:9.1f}x | {r['bitwise_by_arm'].get(name, True)}")
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0 if all(r["bitwise_equal"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
