"""Tile configs for decode-sized windows: which are bitwise equal to the prefill tiles, and which is fastest.

    python bench/probe_decode_tiles.py --out bench/results/decode_tiles_h200.json     # GPU

A decode step (M = 1 .. 16 rows) streams every weight once; the M <= 16 linear config and the
attention's one-program-per-query config decide how fast. --only fp32: the fp32 products (the
indexer's head weights, the router: FMA dots) the same way; --only head: the absorbed per-head
products (head_linear) against T = 2048's rows. A decode config may differ from the
prefill one only if it gives every row the same bits (glm53/ops/triton_linear.py: CONFIG_BY_ROWS).
For each GLM-5.3 linear shape (N, K) and each candidate (BLOCK_M 16, BLOCK_N, BLOCK_K, warps,
stages): rows of M = 1, 3 and 16 at several offsets against the same rows of an M = 2048 product
with the prefill config (torch.equal), and the M = 1 time: a CUDA graph of calls over weight copies
that do not fit in L2, replayed, timed with CUDA events. Likewise latent_attention at T = 1 and 4
for BLOCK_H, BLOCK_N, warps, stages against the T = 64 call with the prefill config.
Prints the best bitwise-equal config per shape; JSON with every candidate.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchmeta import result_header, write_json  # noqa: E402

LINEAR_SHAPES = {  # (N, K): what it is at GLM-5.3 size
    (2048, 6144): "q_a", (16384, 2048): "q_b", (576, 6144): "kv_a", (6144, 16384): "o_proj",
    (4096, 2048): "indexer wq_b", (128, 6144): "indexer wk", (12288, 6144): "mlp gate/up",
    (6144, 12288): "mlp down", (32768, 6144): "head (bench vocab)", (4096, 6144): "expert gate_up",
    (6144, 2048): "expert down"}
FP32_SHAPES = {(32, 6144): "indexer weights_proj", (256, 6144): "router"}  # fp32 x and w, FMA dots
ROTATE_BYTES = 256 << 20


def graph_time_us(calls: list[Callable[[], Any]], replays: int = 10) -> float:
    """Mean GPU time of one call: the calls captured in one CUDA graph, replayed, event-timed."""
    for f in calls[:2]:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(calls))


def _bf16_candidates(tl_) -> list:
    return [tl_.LinearConfig(16, bn, bk, w, s) for bn, bk, w, s in
            itertools.product((16, 32, 64), (64, 128, 256), (2, 4), (3, 5))]


def _fp32_candidates(tl_) -> list:
    # FMA dots (input_precision="ieee"): BLOCK_N 16 doubles the programs of a 32-column product
    return [tl_.LinearConfig(16, bn, bk, w, s) for bn, bk, w, s in
            itertools.product((16, 32), (32, 64, 128), (2, 4), (2, 4))]


def probe_linear(dev: torch.device, shapes: dict[tuple[int, int], str] = LINEAR_SHAPES,
                 dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """Each decode candidate against the M = 2048 product's rows (the prefill config), and its M = 1 time."""
    from glm53.ops import triton_linear as tl_

    out = []
    g = torch.Generator(device=dev).manual_seed(0)
    candidates = _fp32_candidates(tl_) if dtype == torch.float32 else _bf16_candidates(tl_)
    for (n, k), what in shapes.items():
        x = (torch.randn(2048, k, generator=g, device=dev) * k ** -0.5).to(dtype)
        w = torch.randn(n, k, generator=g, device=dev).to(dtype)
        full = tl_.linear(x, w, tl_.linear_config(2048, n, k, dtype))
        out.append(_probe_shape({"n": n, "k": k, "what": what, "dtype": str(dtype)}, tl_.linear, x, w, full,
                                tl_.linear_config(1, n, k, dtype), candidates))
    return out


def probe_head_linear(dev: torch.device) -> list[dict[str, Any]]:
    """The absorbed per-head products (head_linear, 64 heads): decode candidates against T = 2048's rows."""
    from glm53.ops import triton_linear as tl_

    out, bf16 = [], torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(2)
    candidates = [tl_.LinearConfig(16, bn, bk, w, s) for bn, bk, w, s in
                  itertools.product((32, 64, 128), (64, 128), (4, 8), (2, 3))]
    for heads, n, k, what in ((64, 512, 192, "w_uk (q_nope -> latent)"), (64, 256, 512, "w_uv (latent -> value)")):
        x = (torch.randn(2048, heads, k, generator=g, device=dev) * k ** -0.5).to(bf16)
        w = torch.randn(heads, n, k, generator=g, device=dev).to(bf16)
        out.append(_probe_shape({"heads": heads, "n": n, "k": k, "what": what}, tl_.head_linear, x, w,
                                tl_.head_linear(x, w), tl_.head_linear_config(n, k, bf16, 1), candidates))
    return out


def _probe_shape(fields: dict[str, Any], product: Callable, x: torch.Tensor, w: torch.Tensor, full: torch.Tensor,
                 now, candidates: list) -> dict[str, Any]:
    """product(x, w, config) for each candidate: bitwise against `full`'s rows (M = 1, 3, 16 at several
    offsets) and its M = 1 time over weight copies that do not fit in L2; the config in use as `now`."""
    copies = [w] + [w.clone() for _ in range(max(1, min(15, ROTATE_BYTES // w.nbytes)) - 1)]
    rows = []
    for cfg in candidates:
        try:
            same = all(torch.equal(product(x[o:o + m], w, cfg), full[o:o + m])
                       for m, o in ((1, 0), (1, 777), (3, 5), (16, 1024), (16, 2032)))
            us = graph_time_us([lambda c=c, cfg=cfg: product(x[:1], c, cfg) for c in copies])
        except Exception as exc:  # noqa: BLE001 - a config the compiler rejects (shared memory)
            rows.append({"config": cfg.__dict__, "error": str(exc).splitlines()[0][:160]})
            continue
        rows.append({"config": cfg.__dict__, "bitwise": same, "us_m1": us, "gbps": w.nbytes / us / 1e3})
    now_us = graph_time_us([lambda c=c: product(x[:1], c) for c in copies])
    ok = [r for r in rows if r.get("bitwise")]
    best = min(ok, key=lambda r: r["us_m1"]) if ok else None
    summary = {**fields, "current": now.__dict__, "current_us": now_us, "best": best,
               "all_bitwise": all(r.get("bitwise", True) for r in rows), "candidates": rows}
    print(f"{fields['what']:26} N={fields['n']:6} K={fields['k']:6}: now {now_us:7.1f} us; best bitwise "
          f"{best['config'] if best else None} {best['us_m1'] if best else float('nan'):7.1f} us "
          f"({best['gbps'] if best else 0:.0f} GB/s); every candidate bitwise: {summary['all_bitwise']}", flush=True)
    return summary


def probe_attention(dev: torch.device) -> list[dict[str, Any]]:
    from glm53.ops import triton_attention as ta

    bf16, g = torch.bfloat16, torch.Generator(device=dev).manual_seed(1)
    heads, d, dv, slots, history = 64, 576, 512, 2048, 20000
    rows = torch.randn(history, d, generator=g, device=dev).to(bf16)
    q = (torch.randn(64, heads, d, generator=g, device=dev) * d ** -0.5).to(bf16)
    idx = torch.stack([torch.randperm(history, generator=g, device=dev)[:slots].sort().values for _ in range(64)])
    valid = torch.ones(64, slots, dtype=torch.bool, device=dev)
    valid[5, 1500:] = False
    full = ta.latent_attention(q, rows, idx, valid, d ** -0.5, dv)
    saved = ta.attention_config
    out = []
    try:
        for bh, bn, w, s in itertools.product((16, 32, 64), (32, 64), (4, 8), (1, 2)):
            ta.attention_config = lambda *a, c=(bh, bn, w, s): c  # noqa: E731
            try:
                same = all(torch.equal(ta.latent_attention(q[o:o + t], rows, idx[o:o + t], valid[o:o + t],
                                                           d ** -0.5, dv)[i], full[i][o:o + t])
                           for t, o in ((1, 0), (1, 5), (4, 20)) for i in (0, 1))
                us = graph_time_us([lambda o=o: ta.latent_attention(q[o:o + 1], rows, idx[o:o + 1], valid[o:o + 1],
                                                                    d ** -0.5, dv) for o in range(0, 64, 4)])
            except Exception as exc:  # noqa: BLE001
                out.append({"config": [bh, bn, w, s], "error": str(exc).splitlines()[0][:160]})
                continue
            out.append({"config": [bh, bn, w, s], "bitwise": same, "us_t1": us})
            print(f"attention BLOCK_H={bh} BLOCK_N={bn} warps={w} stages={s}: bitwise {same}, {us:.1f} us at T=1",
                  flush=True)
    finally:
        ta.attention_config = saved
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "decode_tiles.json")
    ap.add_argument("--only", choices=("linear", "fp32", "head", "attention"), default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: this probe needs a CUDA device", file=sys.stderr)
        return 3
    dev = torch.device("cuda")
    result = result_header("decode_tiles", {"rotate_bytes": ROTATE_BYTES}, device=dev)
    with torch.inference_mode():
        if args.only in (None, "linear"):
            result["linear"] = probe_linear(dev)
        if args.only in (None, "fp32"):
            result["linear_fp32"] = probe_linear(dev, FP32_SHAPES, torch.float32)
        if args.only in (None, "head"):
            result["head_linear"] = probe_head_linear(dev)
        if args.only in (None, "attention"):
            result["attention"] = probe_attention(dev)
    write_json(args.out, result)
    print(f"full results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
