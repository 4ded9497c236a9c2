"""latent_attention for short windows: the split kernels' configs, their bits against the prefill
kernel, and their speed against it.

    python bench/probe_split_attention.py --out bench/results/split_attention_h200.json     # GPU

For each values-kernel config (BLOCK_V, warps, stages, RELAYOUT) and each case (GLM-5.3: 64 heads x 576,
value 512, bf16 and fp32; the tiny model's 4 x 80, value 64): `agreement` (random queries, both
ways, torch.equal), then T = 1, 4 and 16 queries over 2048 selected slots of a 20000-row cache
(plus a DCP-like case: every fourth slot valid) compared bitwise with the prefill kernel, and the
time of both ways: a CUDA graph of 16 calls on rotating queries, replayed, CUDA events.
Prints one line per config and case; JSON with every one.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchmeta import result_header, write_json  # noqa: E402
from bench.probe_decode_tiles import graph_time_us  # noqa: E402

CASES = {"glm53_bf16": (64, 576, 512, torch.bfloat16), "glm53_fp32": (64, 576, 512, torch.float32),
         "tiny_bf16": (4, 80, 64, torch.bfloat16)}
WINDOWS = (1, 4, 16)


def inputs(heads: int, d: int, dtype: torch.dtype, dev: torch.device, every: int = 1):
    g = torch.Generator(device=dev).manual_seed(7)
    history, slots, t = 20000, 2048, 64
    rows = torch.randn(history, d, generator=g, device=dev).to(dtype)
    q = (torch.randn(t, heads, d, generator=g, device=dev) * d ** -0.5).to(dtype)
    idx = torch.stack([torch.randperm(history, generator=g, device=dev)[:slots].sort().values for _ in range(t)])
    valid = torch.zeros(t, slots, dtype=torch.bool, device=dev)
    valid[:, ::every] = True
    return q, rows, idx, valid


def probe_case(name: str, heads: int, d: int, dv: int, dtype: torch.dtype, dev: torch.device,
               configs: list[tuple[int, int, int, int]]) -> list[dict[str, Any]]:
    from glm53.ops import triton_attention as ta

    scale = d ** -0.5
    dense, sparse = inputs(heads, d, dtype, dev), inputs(heads, d, dtype, dev, every=4)
    out = []
    saved = ta.split_candidates
    try:
        base = {}
        for label, (q, rows, idx, valid) in (("dense", dense), ("every4", sparse)):
            for t in WINDOWS:
                base[label, t] = graph_time_us([lambda o=o, t=t: ta.latent_attention(
                    q[o:o + t], rows, idx[o:o + t], valid[o:o + t], scale, dv, split=False)
                    for o in range(0, 64 - t, 4)])
        for cfg in configs:
            ta.split_candidates = lambda *a, c=cfg: [c]  # noqa: E731
            ta._CHOSEN.clear()
            row: dict[str, Any] = {"case": name, "config": list(cfg)}
            try:
                row["agreement"] = ta.agreement(heads, d, dv, dtype, dtype, dev, cfg)
                same = True
                for label, (q, rows, idx, valid) in (("dense", dense), ("every4", sparse)):
                    whole = ta.latent_attention(q, rows, idx, valid, scale, dv, split=False)
                    for t in WINDOWS:
                        for o in (0, 5, 64 - t):
                            part = ta.latent_attention(q[o:o + t], rows, idx[o:o + t], valid[o:o + t], scale, dv,
                                                       split=True)
                            same &= torch.equal(part[0], whole[0][o:o + t]) and torch.equal(part[1], whole[1][o:o + t])
                        row[f"us_{label}_t{t}"] = graph_time_us([lambda o=o, t=t: ta.latent_attention(
                            q[o:o + t], rows, idx[o:o + t], valid[o:o + t], scale, dv, split=True)
                            for o in range(0, 64 - t, 4)])
                        row[f"us_{label}_t{t}_prefill_kernel"] = base[label, t]
                row["bitwise"] = same
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
                row["error"] = str(exc).splitlines()[0][:200]
            out.append(row)
            times = " ".join(f"T={t}: {row.get(f'us_dense_t{t}', float('nan')):.1f} vs "
                             f"{base['dense', t]:.1f} us" for t in WINDOWS)
            print(f"{name} BLOCK_V={cfg[0]} warps={cfg[1]} stages={cfg[2]} relayout={cfg[3]}: agreement {row.get('agreement')} "
                  f"bitwise {row.get('bitwise')} | split vs prefill kernel {times} | every4 T=1 "
                  f"{row.get('us_every4_t1', float('nan')):.1f} vs {base['every4', 1]:.1f} us "
                  f"{row.get('error', '')}", flush=True)
    finally:
        ta.split_candidates = saved
        ta._CHOSEN.clear()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "split_attention.json")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: this probe needs a CUDA device", file=sys.stderr)
        return 3
    dev = torch.device("cuda")
    configs = list(itertools.product((32, 64), (4, 8), (1, 2), (0, 1, 2)))
    result = result_header("split_attention", {"windows": list(WINDOWS), "slots": 2048, "history": 20000},
                           device=dev)
    result["rows"] = []
    with torch.inference_mode():
        for name in args.cases:
            heads, d, dv, dtype = CASES[name]
            result["rows"] += probe_case(name, heads, d, dv, dtype, dev, configs)
    write_json(args.out, result)
    print(f"full results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
