"""One prefill chunk's attention cost against the history length: the reference's dense-masked form vs
the model's path (absorbed, each query over its own top-k rows, through glm53.ops).

    python -m bench.bench_prefill_history --out bench/results/prefill_history_h200.json       # GPU, GLM-5.3 dims
    python -m bench.bench_prefill_history --small --out /tmp/prefill_history_small.json     # CPU, small dims

For each history length Tk: C queries at positions [Tk - C, Tk) (the last grid chunk of a Tk-token
context) over a Tk-row latent cache, random weights at GLM-5.3 dims (H 64, r 512, rope 64, nope 192,
v 256, index_topk k 2048, indexer 32 heads x 128, C 2048; --small: H 8, r 128, rope 16, nope 32, v 32,
k 128, indexer 8 x 64, C 256). Timed side by side, interleaved per sample:

  expanded      mla.attend_expanded(w, q_nope, q_rot, cached, mask)          (the reference's formulation)
  attend        mla.attend(w, q_nope, q_rot, cached, selection)              (the model's path, glm53.ops)
  index_scores  indexer.index_scores for the same queries/keys               (the O(Tk) scoring)
  select        indexer.select_topk(scores, k)                                (the top-k with its tie rule)

Checks per Tk (reported, not timed): max |attend - expanded| over out, and whether the model's path
over the first 7 queries alone equals those rows of the whole chunk, bitwise (row invariance). GPU: CUDA events after --warmup discarded runs, cache
rows rotated over up to 64 copies (>= 128 MB: more than the H200's L2; the expanded path's own
buffers are far larger anyway). CPU: perf_counter. Memory at Tk 64k on GPU: ~35 GB peak (expanded).

Prints a table last; writes JSON (git commit, device, versions, settings, every sample,
median/min/max). Exit 0 on success, 2 on bad arguments, 3 when the asked-for device is missing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

from bench.lib.meta import RESULTS, git_commit
from bench.lib.timing import call_timer
from glm53.model.indexer import IndexerWeights, Selection, index_scores, select_topk
from glm53.model.mla import AttentionWeights, attend, attend_expanded

FULL = dict(hidden=6144, heads=64, rank=512, rope=64, nope=192, v=256, k=2048, chunk=2048, ix_heads=32, ix_dim=128,
            history=[2048, 4096, 8192, 16384, 32768, 65536])
SMALL = dict(hidden=512, heads=8, rank=128, rope=16, nope=32, v=32, k=128, chunk=256, ix_heads=8, ix_dim=64,
             history=[1024, 2048, 4096, 8192])
ROTATE_BYTES = 128 << 20
METHODS = ("expanded", "attend", "index_scores", "select")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def build(d: dict, device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple[AttentionWeights, IndexerWeights]:
    def rand(*shape: int, std: float = 0.02, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * std).to(dt)

    none = torch.zeros(1, 1, device=device, dtype=dtype)  # projections this bench does not run
    attn = AttentionWeights(q_a=none, q_a_norm=none, q_b=none, kv_a=none, kv_a_norm=none,
                            kv_b=rand(d["heads"] * (d["nope"] + d["v"]), d["rank"], std=0.05), o=none,
                            n_heads=d["heads"], nope=d["nope"], rope=d["rope"], v_dim=d["v"], kv_rank=d["rank"],
                            scale=(d["nope"] + d["rope"]) ** -0.5)
    ix = IndexerWeights(wq_b=none, wk=none, k_norm_weight=none, k_norm_bias=none,
                        weights_proj=rand(d["ix_heads"], d["hidden"], dt=torch.float32),
                        n_heads=d["ix_heads"], head_dim=d["ix_dim"], rope_dim=d["rope"])
    return attn, ix


def summary(samples: list[float]) -> dict:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples), "samples_s": samples}


def run_history(d: dict, tk: int, attn: AttentionWeights, ix: IndexerWeights, device: torch.device,
                dtype: torch.dtype, g: torch.Generator, reps: int, warmup: int) -> dict:
    C, k = d["chunk"], d["k"]
    latent = d["rank"] + d["rope"]
    row_bytes = tk * latent * torch.finfo(dtype).bits // 8
    copies = max(1, min(64, -(-ROTATE_BYTES // row_bytes))) if device.type == "cuda" else 1
    cached = [torch.randn(tk, latent, generator=g, device=device).to(dtype) for _ in range(copies)]
    keys = torch.randn(tk, d["ix_dim"], generator=g, device=device).to(dtype)
    x_norm = torch.randn(C, d["hidden"], generator=g, device=device).to(dtype)
    q_idx = torch.randn(C, d["ix_heads"], d["ix_dim"], generator=g, device=device).to(dtype)
    q_nope = torch.randn(C, d["heads"], d["nope"], generator=g, device=device).to(dtype)
    q_rot = torch.randn(C, d["heads"], d["rope"], generator=g, device=device).to(dtype)
    q_pos = torch.arange(tk - C, tk, device=device)
    scores = index_scores(ix, q_idx, x_norm, keys, q_pos)
    selection = select_topk(scores, k)
    mask = selection.mask(tk)
    turn = [0]

    def rows() -> torch.Tensor:
        turn[0] += 1
        return cached[turn[0] % copies]

    calls: dict[str, Callable[[], object]] = {
        "expanded": lambda: attend_expanded(attn, q_nope, q_rot, rows(), mask),
        "attend": lambda: attend(attn, q_nope, q_rot, rows(), selection),
        "index_scores": lambda: index_scores(ix, q_idx, x_norm, keys, q_pos),
        "select": lambda: select_topk(scores, k),
    }
    time_one = call_timer(device)
    for _ in range(warmup):
        for fn in calls.values():
            time_one(fn)
    samples: dict[str, list[float]] = {m: [] for m in METHODS}
    for _ in range(reps):  # interleaved: every method once per round
        for name, fn in calls.items():
            samples[name].append(time_one(fn))

    dense = attend_expanded(attn, q_nope, q_rot, cached[0], mask)
    ours = attend(attn, q_nope, q_rot, cached[0], selection)
    few = attend(attn, q_nope[:7], q_rot[:7], cached[0], Selection(selection.indices[:7], selection.valid[:7]))
    checks = {
        "max_abs_diff_out_vs_expanded": float((ours[0].float() - dense[0].float()).abs().max()),
        "max_abs_out_expanded": float(dense[0].float().abs().max()),
        "rows_invariant_7_of_chunk": bool(torch.equal(few[0], ours[0][:7]) and torch.equal(few[1], ours[1][:7])),
    }
    del cached, scores, selection, mask
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"history": tk, "rotated_copies": copies, "checks": checks,
            "methods": {m: summary(s) for m, s in samples.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="small dims on CPU (a check of the script)")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cpu with --small, else cuda)")
    ap.add_argument("--history", type=int, nargs="+", default=None, help="history lengths Tk (each >= chunk)")
    ap.add_argument("--reps", type=int, default=None, help="timed samples per method (default 10 GPU, 3 CPU)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "prefill_history.json"))
    args = ap.parse_args()

    d = dict(SMALL if args.small else FULL)
    device = torch.device(args.device or ("cpu" if args.small else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: CUDA is not available here; run with --small (CPU) or on the GPU machine", file=sys.stderr)
        return 3
    history = args.history or d["history"]
    if any(tk < d["chunk"] for tk in history):
        print(f"error: every --history value must be >= the chunk ({d['chunk']}), got {history}", file=sys.stderr)
        return 2
    reps = args.reps or (10 if device.type == "cuda" else 3)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    attn, ix = build(d, device, dtype, g)

    results = []
    for tk in history:
        print(f"Tk={tk}: timing {len(METHODS)} methods x {reps} samples ...", file=sys.stderr, flush=True)
        results.append(run_history(d, tk, attn, ix, device, dtype, g, reps, args.warmup))

    report = {
        "bench": "prefill_history", "git_commit": git_commit(), "device": device_name(device),
        "versions": {"torch": torch.__version__, "triton": version("triton"), "python": platform.python_version()},
        "settings": {**{key: d[key] for key in d if key != "history"}, "history": history, "dtype": str(dtype),
                     "reps": reps, "warmup": args.warmup, "small": args.small,
                     "timing": "cuda events" if device.type == "cuda" else "perf_counter"},
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out)

    print(f"\n{report['device']}, {dtype}, C={d['chunk']} k={d['k']} H={d['heads']}: median ms per chunk "
          f"(min/max and every sample in {out})")
    head = (f"{'Tk':>6} | " + " | ".join(f"{m:>12}" for m in METHODS)
            + " | expanded/attend | max|diff| | rows invariant")
    print(head)
    print("-" * len(head))
    for r in results:
        m, c = r["methods"], r["checks"]
        med = {x: m[x]["median_s"] * 1e3 for x in METHODS}
        print(f"{r['history']:>6} | " + " | ".join(f"{med[x]:12.2f}" for x in METHODS)
              + f" | {med['expanded'] / med['attend']:15.2f}"
              f" | {c['max_abs_diff_out_vs_expanded']:9.1e} | {c['rows_invariant_7_of_chunk']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
