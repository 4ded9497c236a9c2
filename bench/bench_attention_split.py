"""Small-window attention with the value columns split over programs, against one program per query.

    python bench/bench_attention_split.py --out bench/results/attention_split_h200.json

GLM-5.3's absorbed MLA on one rank (64 heads, D = 576, value 512, 2048 selected slots of a 19k
cache), windows of 1, 4 and 16 queries. Per window and value slice width (512 = unsplit: what
prefill runs; 256, 128, 64, 32), and num_warps (4, 8): the output and lse against the unsplit
kernel bit for bit, and the time (triton.testing.do_bench, median). A config whose bits differ is
listed and never timed as a candidate. Prints a table; JSON to --out. Exit 1 if the kernel's own
choice (triton_attention.value_part) gives different bits, 3 without CUDA.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchmeta import result_header, write_json  # noqa: E402

HEADS, D, DV, SLOTS, CACHE = 64, 576, 512, 2048, 19000


def run(q, rows, idx, valid, part: int, warps: int):
    """The kernel with a forced value slice width and warp count (stages as the kernel picks)."""
    from glm53.ops import triton_attention as ta

    saved_part, saved_cfg = ta.value_part, ta.attention_config
    ta.value_part = lambda t, block_dv: part
    ta.attention_config = lambda *a: (*saved_cfg(*a)[:2], warps, saved_cfg(*a)[3])
    try:
        return ta.latent_attention(q, rows, idx, valid, D ** -0.5, DV)
    finally:
        ta.value_part, ta.attention_config = saved_part, saved_cfg


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "attention_split.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: needs CUDA (run on the GPU machine)", file=sys.stderr)
        return 3
    import triton

    from glm53.ops import triton_attention as ta

    g = torch.Generator(device="cuda").manual_seed(7)
    rows = torch.randn(CACHE, D, generator=g, device="cuda").to(torch.bfloat16)
    results: list[dict[str, Any]] = []
    own_ok = True
    for t in (1, 4, 16):
        q = torch.randn(t, HEADS, D, generator=g, device="cuda").to(torch.bfloat16)
        idx = torch.stack([torch.randperm(CACHE, generator=g, device="cuda")[:SLOTS] for _ in range(t)])
        valid = torch.ones(t, SLOTS, dtype=torch.bool, device="cuda")
        ref = run(q, rows, idx, valid, DV, 8)
        own = ta.latent_attention(q, rows, idx, valid, D ** -0.5, DV)
        own_same = torch.equal(own[0], ref[0]) and torch.equal(own[1], ref[1])
        own_ok &= own_same
        for part in (512, 256, 128, 64, 32):
            for warps in (4, 8):
                try:
                    out = run(q, rows, idx, valid, part, warps)
                except triton.runtime.errors.OutOfResources as exc:
                    print(f"t={t} slice {part} warps {warps}: {exc}", file=sys.stderr)
                    continue
                same = torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
                ms = triton.testing.do_bench(lambda: run(q, rows, idx, valid, part, warps), warmup=20, rep=200)
                results.append({"t": t, "part": part, "warps": warps, "bitwise": same, "ms": ms,
                                "kernel_choice": part == ta.value_part(t, DV) and warps == 8})
        print(f"t={t}: the kernel's own choice (slice {ta.value_part(t, DV)}) bitwise {own_same}", file=sys.stderr)
    print(f"{'t':>3} {'slice':>5} {'warps':>5} {'bitwise':>7} {'us':>8} {'vs unsplit':>10}")
    for r in results:
        base = next(x["ms"] for x in results if x["t"] == r["t"] and x["part"] == 512 and x["warps"] == 8)
        r["speedup_vs_unsplit"] = base / r["ms"]
        mark = " <- kernel" if r["kernel_choice"] else ""
        print(f"{r['t']:>3} {r['part']:>5} {r['warps']:>5} {str(r['bitwise']):>7} {r['ms'] * 1e3:>8.1f} "
              f"{r['speedup_vs_unsplit']:>9.2f}x{mark}")
    settings = {"heads": HEADS, "d": D, "value_dim": DV, "slots": SLOTS, "cache_rows": CACHE, "dtype": "bf16",
                "timing": "triton.testing.do_bench median"}
    write_json(args.out, {**result_header("attention_split", settings, device="cuda"), "results": results,
                          "kernel_choice_bitwise": own_ok})
    return 0 if own_ok else 1


if __name__ == "__main__":
    sys.exit(main())
