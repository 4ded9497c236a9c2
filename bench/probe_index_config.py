"""Tile configs of the indexer's scores kernel (glm53/ops/triton_indexer.py) at a turn's prefill pieces.

    python bench/probe_index_config.py --out bench/results/index_config_h200.json     # GPU

The kernel's config comes from (H, D, dtype) alone, so any config keeps the scores row- and
key-invariant; a new one changes which bits every call gives, not whether cache on and off agree.
For GLM-5.3's indexer (32 heads x 128, bf16) and each candidate (BLOCK_T, BLOCK_N, warps, stages):
the GPU time of a call (CUDA graph of calls, replayed, CUDA events) at the six-turn bench's prefill
pieces (turn 1: 2048 queries over 2048 keys, 652 over 2700; turn 6: 2048 over 15552, 653 over
16205; causal), median of --repeats, candidates alternating; and whether its scores equal the
current config's bit for bit. Prints a table (the current config first); JSON with every sample.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchmeta import result_header, write_json  # noqa: E402
from bench.probe_decode_tiles import graph_time_us  # noqa: E402

HEADS, DIM = 32, 128
PIECES = [(2048, 0), (652, 2048), (2048, 13504), (653, 15552)]  # (queries, cached positions before them)
CANDIDATES = [(64, 128, 4, 3), (64, 128, 4, 2), (64, 128, 4, 4), (64, 256, 8, 3), (128, 128, 8, 3),
              (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 256, 8, 2)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "index_config.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: this probe times a CUDA kernel: no CUDA device here", file=sys.stderr)
        return 2
    from glm53.ops import triton_indexer

    dev = torch.device("cuda")
    original = triton_indexer.index_config
    current = original(HEADS, DIM, torch.bfloat16)
    candidates = [current] + [c for c in CANDIDATES if c != current]
    g = torch.Generator(device=dev).manual_seed(13)
    rows = []
    for t, history in PIECES:
        n = history + t
        q = torch.randn(t, HEADS, DIM, generator=g, device=dev).to(torch.bfloat16)
        hw = torch.randn(t, HEADS, generator=g, device=dev)
        keys = torch.randn(n, DIM, generator=g, device=dev).to(torch.bfloat16)
        qpos = history + torch.arange(t, device=dev)
        call = lambda: triton_indexer.index_scores(q, hw, keys, DIM ** -0.5, qpos)  # noqa: E731
        want = call()
        samples: dict[tuple, list[float]] = {c: [] for c in candidates}
        same: dict[tuple, bool] = {}
        for i in range(args.repeats):
            for c in (candidates if i % 2 == 0 else candidates[::-1]):
                triton_indexer.index_config = lambda *_, c=c: c
                try:
                    if i == 0:
                        same[c] = bool(torch.equal(call(), want))
                    samples[c].append(graph_time_us([call] * 4))
                finally:
                    triton_indexer.index_config = original
        for c in candidates:
            us = statistics.median(samples[c])
            flops = 2 * HEADS * DIM * (t * history + t * (t + 1) // 2)  # causal: the keys up to each query
            rows.append({"t": t, "keys": n, "config": list(c), "us": us, "samples_us": samples[c],
                         "tflops": flops / us * 1e-6, "same_bits_as_current": same[c]})
            print(f"T {t:5d} keys {n:6d} config {c}: {us:8.1f} us {rows[-1]['tflops']:6.0f} TFLOPS "
                  f"same bits {same[c]}", file=sys.stderr, flush=True)
    write_json(args.out, {**result_header("index_config", {"heads": HEADS, "dim": DIM, "repeats": args.repeats,
                                                            "current": list(current)}, device=dev), "rows": rows})
    print(f"{'T':>5} {'keys':>6} " + " ".join(f"{'x'.join(map(str, c)):>12}" for c in candidates))
    for t, history in PIECES:
        us = {tuple(r["config"]): r["us"] for r in rows if r["t"] == t and r["keys"] == history + t}
        print(f"{t:5d} {history + t:6d} " + " ".join(f"{us[c]:12.1f}" for c in candidates))
    totals = {c: sum(r["us"] for r in rows if tuple(r["config"]) == c) for c in candidates}
    print("sum over pieces (us): " + ", ".join(f"{'x'.join(map(str, c))} {v:.0f}" for c, v in totals.items()))
    print(f"full results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
