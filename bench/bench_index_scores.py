"""The CPU indexer scores: the row-invariant form (one [heads, d] @ [d, keys] product per query)
against the padded all-queries GEMM (which changes bits under MKL's AVX2 kernels), side by side.

    python -m bench.bench_index_scores
    python -m bench.bench_index_scores --repeats 9

Why: the GEMM form (queries padded to a multiple of 8, keys to 16, one product per head) changed
bits under MKL's AVX2 kernels; the per-query form does not (tests/test_row_invariance.py), and this
measures what it costs on the CPU path (tests, reference). Shapes: the tiny checkpoint's indexer
(4 heads x 32) over a 256-query prefill piece and a decode step, and GLM-5.3's (32 x 128). Arms
alternate per sample; each sample is the mean of 3 calls after a warm-up; medians of --repeats.
Both arms' scores are compared (same up to fp32 rounding: they sum in other orders). Prints a
table; JSON (bench/lib/meta.py header) to --out. Exit codes: 0 done, 1 scores disagree, 2 bad
arguments.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.lib.meta import RESULTS, result_header
from glm53.measurement import summary, write_json
from glm53.ops import torch_ops

# (queries, keys, heads, head dim)
SHAPES = ((256, 2048, 4, 32), (256, 19000, 4, 32), (1, 19000, 4, 32), (2048, 2048, 32, 128), (64, 16000, 32, 128))


def padded_gemm(q: torch.Tensor, hw: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The padded-GEMM form the per-query products are compared with: every query in one GEMM per head."""
    def pad(x: torch.Tensor, multiple: int) -> torch.Tensor:
        return F.pad(x, (0, 0, 0, (-x.shape[0]) % multiple))

    q32, k32 = pad(q.to(torch.float32), 8), pad(keys.to(torch.float32), 16)
    out = torch.zeros(q.shape[0], keys.shape[0])
    for h in range(q.shape[1]):
        out += torch.relu((q32[:, h] @ k32.T)[:q.shape[0], :keys.shape[0]] * scale) * hw[:, h, None].float()
    return out


ARMS = {"padded_gemm": padded_gemm, "per_query": torch_ops.index_scores}


def sample(fn, args) -> float:
    t0 = time.perf_counter()
    for _ in range(3):
        fn(*args)
    return (time.perf_counter() - t0) / 3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS / "index_scores_cpu.json")
    args = p.parse_args()
    if args.repeats <= 0:
        print("error: --repeats must be positive", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    rows, agree = [], True
    for m, n, heads, d in SHAPES:
        q, hw, keys = torch.randn(m, heads, d, generator=g), torch.randn(m, heads, generator=g), torch.randn(n, d, generator=g)
        call = (q, hw, keys, d ** -0.5)
        outs = {name: fn(*call) for name, fn in ARMS.items()}  # warm-up, and the comparison
        agree &= torch.allclose(outs["padded_gemm"], outs["per_query"], rtol=1e-5, atol=1e-4)
        times: dict[str, list[float]] = {name: [] for name in ARMS}
        for i in range(args.repeats):
            for name in (list(ARMS) if i % 2 == 0 else list(reversed(ARMS))):
                times[name].append(sample(ARMS[name], call))
        row = {"queries": m, "keys": n, "heads": heads, "head_dim": d,
               **{f"{name}_s": summary(t) for name, t in times.items()}}
        row["cost"] = row["per_query_s"]["median"] / row["padded_gemm_s"]["median"]
        rows.append(row)
        print(f"{m}x{n} ({heads}x{d}): padded GEMM {row['padded_gemm_s']['median'] * 1e3:.2f} ms, per query "
              f"{row['per_query_s']['median'] * 1e3:.2f} ms", file=sys.stderr, flush=True)
    settings = {"shapes": [list(s) for s in SHAPES], "repeats": args.repeats,
                "timing": "mean of 3 calls per sample, arms alternating, medians"}
    write_json(args.out, {**result_header("index_scores", settings), "rows": rows, "agree": agree})
    print(f"\n{'queries x keys':>16} | {'heads x d':>9} | {'padded GEMM ms':>14} | {'per query ms':>12} | cost")
    for r in rows:
        print(f"{r['queries']:>7} x {r['keys']:<6} | {r['heads']:>4} x {r['head_dim']:<3} | "
              f"{r['padded_gemm_s']['median'] * 1e3:14.2f} | {r['per_query_s']['median'] * 1e3:12.2f} | {r['cost']:.2f}x")
    print(f"scores agree (fp32 rounding): {agree}\nfull results: {args.out}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
