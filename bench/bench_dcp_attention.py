"""DCP decode attention at long context against DCP off, emulating R ranks' shards on one GPU.

    python -m bench.bench_dcp_attention [--out results/dcp_attention.json]      # H200: 128k, 512k, 1M
    python -m bench.bench_dcp_attention --small                                 # CPU smoke: 4k, 16k

One decode token, one layer with its own indexer, GLM-5.3 dimensions (64 heads, latent 512 + rope
64, indexer 32 heads x 128, top-k 2048), bf16 cache, what one rank computes:
  off R=1   indexer scores over all n keys, top-k (deterministic keys), attention of 64 heads over
            the 2048 selected latent rows
  off R     TP only: the same indexer work on every rank (it is replicated), attention of 64/R heads
  dcp R     rank 0's shard: indexer over its n/R keys, local top-k, the global top-k merge of R x k
            keys, attention of all 64 heads over the selected rows it owns (~k/R), and the
            log-sum-exp merge of R partials (glm53.dist.dcp's functions, the ones the engine runs)
Communication is not timed here (bench_kv_bytes.py gives the bytes per step); this measures compute.
GPU: CUDA events per call after warm-up, caches rotated over > 500 MB (L2 is 60 MB); variants
interleaved in one loop so ratios are side by side. No CUDA graphs (the engine does not use them yet).
Prints a table last; the JSON holds every sample. Exit 0 on success, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.lib.meta import KIT_ROOT, result_header
from glm53.measurement import summary, write_json
from glm53.dist import dcp, tp

HEADS, KV_RANK, ROPE, IDX_HEADS, IDX_DIM, TOPK = 64, 512, 64, 32, 128, 2048
SCALE = (192 + 64) ** -0.5


def index_scores(q_idx: torch.Tensor, head_w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[n] fp32: sum_h w_h relu(q_h . k / sqrt(d)), as glm53.model.indexer computes it (fp32)."""
    per_head = torch.relu(q_idx.float() @ keys.float().T * IDX_DIM ** -0.5)  # [heads, n]
    return head_w.float() @ per_head


class Layer:
    """One layer's cache (latent rows and indexer keys) for n positions, plus a query."""

    def __init__(self, n: int, device: torch.device, gen: torch.Generator) -> None:
        self.latent = torch.randn(n, KV_RANK + ROPE, generator=gen).to(device, torch.bfloat16)
        self.keys = torch.randn(n, IDX_DIM, generator=gen).to(device, torch.bfloat16)


def make_variants(n: int, R: int, device: torch.device, layers: list[Layer], gen: torch.Generator
                  ) -> dict[str, Callable[[int], object]]:
    q_lat = torch.randn(1, HEADS, KV_RANK, generator=gen).to(device, torch.bfloat16)
    q_rot = torch.randn(1, HEADS, ROPE, generator=gen).to(device, torch.bfloat16)
    q_idx = torch.randn(IDX_HEADS, IDX_DIM, generator=gen).to(device, torch.bfloat16)
    head_w = torch.randn(IDX_HEADS, generator=gen).to(device)
    own = dcp.Ownership(0, R)
    local_n = own.count(n)
    positions_all = torch.arange(n, device=device)
    positions_local = own.positions_of(torch.arange(local_n, device=device))
    h0, h1 = tp.head_ranges(HEADS, R)[0]

    def full(i: int, heads: slice) -> object:
        L = layers[i % len(layers)]
        keys = dcp.local_topk_keys(index_scores(q_idx, head_w, L.keys)[None], positions_all, TOPK)
        _, picked = dcp.decode_keys(keys[0])
        return dcp.attend_latent(q_lat[:, heads], q_rot[:, heads], L.latent[picked], SCALE)

    def shard(i: int) -> object:
        L = layers[i % len(layers)]
        local_keys, local_latent = L.keys[:local_n], L.latent[:local_n]  # rank 0's slots (any rows time alike)
        keys = dcp.local_topk_keys(index_scores(q_idx, head_w, local_keys)[None], positions_local, TOPK)
        # the other ranks' local top-k: the same keys moved to their positions (p + j lives on rank j)
        gathered = torch.stack([torch.where(keys >= 0, keys - j, keys) for j in range(R)])
        _, selected = dcp.merge_topk_keys(gathered, TOPK)
        _, slots = own.select_owned(selected[0])
        out, lse = dcp.attend_latent(q_lat, q_rot, local_latent[slots], SCALE)
        return dcp.merge_partials(out[None].expand(R, -1, -1, -1), lse[None].expand(R, -1, -1))

    return {"off_R1": lambda i: full(i, slice(None)), f"off_R{R}": lambda i: full(i, slice(h0, h1)),
            f"dcp_R{R}": shard}


def time_call(fn: Callable[[int], object], i: int, device: torch.device) -> float:
    """Milliseconds of one call: CUDA events on the GPU, wall clock on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn(i)
    return (time.perf_counter() - t0) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="CPU-sized contexts (4k, 16k) and few reps")
    parser.add_argument("--contexts", type=int, nargs="*", help="context lengths (default 131072 524288 1048576)")
    parser.add_argument("--ranks", type=int, nargs="*", default=[3, 4])
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=KIT_ROOT / "results" / "dcp_attention.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible; use --device cpu --small", file=sys.stderr)
        return 2
    contexts = args.contexts or ([4096, 16384] if args.small else [131072, 524288, 1048576])
    reps = args.reps or (5 if args.small or device.type == "cpu" else 30)
    warmup = 2 if device.type == "cpu" else 5
    gen = torch.Generator().manual_seed(0)

    rows, samples = [], {}
    for n in contexts:
        per_copy = n * (KV_RANK + ROPE + IDX_DIM) * 2
        copies = 1 if device.type == "cpu" else max(2, -(-500 * 2**20 // per_copy))
        layers = [Layer(n, device, gen) for _ in range(copies)]
        for R in args.ranks:
            variants = make_variants(n, R, device, layers, gen)
            got: dict[str, list[float]] = {k: [] for k in variants}
            for i in range(warmup):
                for fn in variants.values():
                    fn(i)
            for i in range(reps):  # interleaved: each rep runs every variant once
                for name, fn in variants.items():
                    got[name].append(time_call(fn, i, device))
            for name, ms in got.items():
                stats = summary(ms, unit="ms")
                rows.append({"context": n, "ranks": R, "variant": name, "median_ms": stats["median_ms"],
                             "min_ms": stats["min_ms"], "max_ms": stats["max_ms"], "samples": stats["n"]})
                samples[f"{n}/{R}/{name}"] = ms
            print(f"# context {n:,} R={R}: " + ", ".join(f"{k} {statistics.median(v):.3f} ms" for k, v in got.items()),
                  file=sys.stderr)
        del layers
        if device.type == "cuda":
            torch.cuda.empty_cache()

    settings = {"heads": HEADS, "kv_rank": KV_RANK, "rope": ROPE, "indexer_heads": IDX_HEADS,
                "indexer_dim": IDX_DIM, "topk": TOPK, "cache_dtype": "bf16", "reps": reps, "warmup": warmup,
                "contexts": contexts, "ranks": args.ranks, "cuda_graphs": False, "communication": "not timed"}
    result = {**result_header("dcp_attention", settings, device=device),
              "torch": torch.__version__, "cuda": torch.version.cuda, "results": rows, "samples_ms": samples}
    write_json(args.out, result)

    print(f"decode attention, one layer, one token ({result['device']}); ms median [min, max] of {reps}")
    print(f"{'context':>10}{'R':>3}  {'off R=1':>28}{'off (TP only)':>28}{'DCP shard+merge':>28}{'DCP/off':>9}")
    for n in contexts:
        for R in args.ranks:
            cell = {r["variant"]: r for r in rows if r["context"] == n and r["ranks"] == R}
            fmt = lambda r: f"{r['median_ms']:.3f} [{r['min_ms']:.3f},{r['max_ms']:.3f}]"  # noqa: E731
            off, on = cell[f"off_R{R}"], cell[f"dcp_R{R}"]
            print(f"{n:>10}{R:>3}  {fmt(cell['off_R1']):>28}{fmt(off):>28}{fmt(on):>28}"
                  f"{on['median_ms'] / off['median_ms']:>9.2f}")
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
