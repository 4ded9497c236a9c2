"""Cost of verifying a window of k = 1..14 tokens against decoding one, per GLM-5.3 layer.

    python -m bench.bench_verify_window --out bench/results/verify_window.json          # CUDA, real dims
    python -m bench.bench_verify_window --small --out /tmp/verify_window_small.json     # CPU, tiny dims

What runs: the kit's own model code (glm53.model.transformer.Glm53Model, the path
draft verification uses) over ONE decoder layer with random bf16 weights at GLM-5.3's real
dimensions (hidden 6144, MLA 64 heads, q/kv LoRA 2048/512, DSA indexer 32x128 top-2048, and
either a dense MLP of 12288 or an MoE of 256 experts x 2048, top 8 + 1 shared), on top of a
context of C cached positions. Plus the LM head (154,880 x 6144) once per forward.
Per k the window is k new tokens at positions [C, C + k); rows are truncated after each sample.

Routing: "random" (router weights random: the k tokens pick experts nearly independently, the
worst case for an MoE window: up to 8k distinct experts are read) and "shared" (every token picks
the same 8 experts: the best case). Real routing lies between; the JSON records the distinct
experts per sample.

Caveats: experts are dense bf16 (DecodedExperts), not EXL3 (~3 bpw): the real pack reads ~5x fewer
expert bytes per expert but through kernels at 3-11% of copy bandwidth (a figure from outside this repository), so the
absolute times here are not the serving kit's; the RATIO t(k)/t(1) is the number that decides how
deep drafting pays (a window pays when expected tokens per step > t(k)/t(1)). The model code syncs
to the host inside the MoE (expert counts), so no CUDA graphs. Timing: CUDA events around each
forward after warm-up, k values interleaved round-robin in one process; weights (GBs per layer)
exceed the 60 MB L2 by far. --small: CPU wall clock on tiny dimensions (plumbing check only).
Exit 0 on success; 2 on bad arguments or no CUDA without --small.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.lib.meta import result_header
from glm53.measurement import installed_version, summary, write_json
from bench.lib.timing import call_timer
from glm53.config import Glm53Config
from glm53.model.indexer import IndexerWeights
from glm53.model.mla import AttentionWeights
from glm53.model.moe import DecodedExperts, MLPWeights, MoEWeights, RouterWeights
from glm53.model.transformer import Glm53Model, LayerWeights, ModelWeights

TINY = dict(vocab_size=1000, hidden_size=256, intermediate_size=768, moe_intermediate_size=512,
            num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4, kv_lora_rank=128,
            q_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, index_topk=64,
            index_head_dim=64, index_n_heads=2)


def _rand(shape, device, dtype, g, std=0.02) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)


def build_layer(cfg: Glm53Config, kind: str, routing: str, device: str, dtype: torch.dtype, seed: int) -> LayerWeights:
    g = torch.Generator(device=device).manual_seed(seed)
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    ones = lambda n: torch.ones(n, device=device, dtype=dtype)  # noqa: E731
    attn = AttentionWeights(
        q_a=_rand((cfg.q_lora_rank, h), device, dtype, g), q_a_norm=ones(cfg.q_lora_rank),
        q_b=_rand((heads * cfg.qk_head_dim, cfg.q_lora_rank), device, dtype, g),
        kv_a=_rand((cfg.latent_dim, h), device, dtype, g), kv_a_norm=ones(cfg.kv_lora_rank),
        kv_b=_rand((heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), device, dtype, g),
        o=_rand((h, heads * cfg.v_head_dim), device, dtype, g), n_heads=heads, nope=cfg.qk_nope_head_dim,
        rope=cfg.qk_rope_head_dim, v_dim=cfg.v_head_dim, kv_rank=cfg.kv_lora_rank, scale=cfg.qk_head_dim ** -0.5)
    indexer = IndexerWeights(
        wq_b=_rand((cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), device, dtype, g),
        wk=_rand((cfg.index_head_dim, h), device, dtype, g), k_norm_weight=ones(cfg.index_head_dim),
        k_norm_bias=torch.zeros(cfg.index_head_dim, device=device, dtype=dtype),
        weights_proj=_rand((cfg.index_n_heads, h), device, torch.float32, g), n_heads=cfg.index_n_heads,
        head_dim=cfg.index_head_dim, rope_dim=cfg.qk_rope_head_dim)
    if kind == "dense":
        w = cfg.intermediate_size
        ffn = MLPWeights(_rand((w, h), device, dtype, g), _rand((w, h), device, dtype, g), _rand((h, w), device, dtype, g))
    else:
        e, w = cfg.n_routed_experts, cfg.moe_intermediate_size
        router_w = _rand((e, h), device, torch.float32, g, std=1.0 if routing == "random" else 0.0)
        router = RouterWeights(weight=router_w, bias=_rand((e,), device, torch.float32, g, std=1.0),
                               top_k=cfg.num_experts_per_tok, n_group=1, topk_group=1, norm_topk_prob=True,
                               scaling=cfg.routed_scaling_factor)
        experts = CountingExperts(DecodedExperts(_rand((e, 2 * w, h), device, dtype, g), _rand((e, h, w), device, dtype, g)))
        shared = MLPWeights(_rand((w, h), device, dtype, g), _rand((w, h), device, dtype, g), _rand((h, w), device, dtype, g))
        ffn = MoEWeights(router=router, experts=experts, shared=shared)
    return LayerWeights(index=0, input_norm=ones(h), post_norm=ones(h), attn=attn, indexer=indexer, ffn=ffn)


class CountingExperts:
    """DecodedExperts that remember how many distinct experts the last call read."""

    def __init__(self, inner: DecodedExperts) -> None:
        self.inner, self.n_experts, self.last_distinct = inner, inner.n_experts, 0

    def __call__(self, x, ids, weights):
        self.last_distinct = int(ids.unique().numel())
        return self.inner(x, ids, weights)


def bench_case(cfg, kind, routing, context, ks, reps, warmup, device, dtype, seed) -> dict:
    layer = build_layer(cfg, kind, routing, device, dtype, seed)
    embed = _rand((1024, cfg.hidden_size), device, dtype, torch.Generator(device=device).manual_seed(seed + 1), std=1.0)
    model = Glm53Model(cfg, ModelWeights(embed=embed, layers=[layer], final_norm=torch.ones(cfg.hidden_size, device=device, dtype=dtype),
                                         head=embed), dtype=dtype, device=device)
    state = model.new_state()
    g = torch.Generator(device=device).manual_seed(seed + 2)
    state.reserve(context + max(ks))
    state.write_latent(0, 0, _rand((context, cfg.latent_dim), device, dtype, g, std=1.0))
    state.write_index(0, 0, _rand((context, cfg.index_head_dim), device, dtype, g, std=1.0))
    state.tokens.extend([0] * context)
    seconds = call_timer(device)
    samples: dict[int, list[float]] = {k: [] for k in ks}
    distinct: dict[int, list[int]] = {k: [] for k in ks}
    tok_g = torch.Generator().manual_seed(seed + 3)
    for rep in range(warmup + reps):
        for k in ks:                                      # interleaved: every k sees the same conditions
            toks = torch.randint(0, 1024, (k,), generator=tok_g).tolist()
            us = seconds(lambda: model.forward(state, toks, context)) * 1e6
            state.truncate(context)
            if rep >= warmup:
                samples[k].append(us)
                if kind == "moe":
                    distinct[k].append(layer.ffn.experts.last_distinct)
    del model, layer, state
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"kind": kind, "routing": routing if kind == "moe" else None, "context": context,
            "samples_us": {str(k): v for k, v in samples.items()},
            "distinct_experts": {str(k): v for k, v in distinct.items()} if kind == "moe" else None}


def bench_head(cfg, ks, reps, warmup, device, dtype, seed) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    head = _rand((cfg.vocab_size, cfg.hidden_size), device, dtype, g)
    seconds = call_timer(device)
    samples: dict[int, list[float]] = {k: [] for k in ks}
    for rep in range(warmup + reps):
        for k in ks:
            x = _rand((k, cfg.hidden_size), device, dtype, g, std=1.0)
            us = seconds(lambda: (x @ head.T).float()) * 1e6
            if rep >= warmup:
                samples[k].append(us)
    return {"kind": "lm_head", "routing": None, "context": None, "samples_us": {str(k): v for k, v in samples.items()},
            "distinct_experts": None}


def summarize(case: dict) -> None:
    stats = {}
    base = statistics.median(case["samples_us"]["1"])
    for k, v in case["samples_us"].items():
        stats[k] = {**summary(v, unit="us"), "ratio_to_k1": statistics.median(v) / base}
        if case["distinct_experts"]:
            stats[k]["median_distinct_experts"] = statistics.median(case["distinct_experts"][k])
    case["summary"] = stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny dimensions on the CPU (plumbing check)")
    ap.add_argument("--out", default="bench/results/verify_window.json", help="JSON results path")
    ap.add_argument("--contexts", default="4096,32768", help="cached positions before the window (comma list)")
    ap.add_argument("--max-k", type=int, default=14)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c]
    except ValueError:
        print(f"bench_verify_window: --contexts must be comma-separated integers, got {args.contexts!r}", file=sys.stderr)
        return 2
    if not 1 <= args.max_k <= 64 or args.reps < 1:
        print("bench_verify_window: --max-k must be 1..64 and --reps >= 1", file=sys.stderr)
        return 2
    if args.small:
        device, dtype, cfg = "cpu", torch.float32, Glm53Config.from_dict({"model_type": "glm_moe_dsa", **TINY})
        contexts = [min(c, 256) for c in contexts]
    else:
        if not torch.cuda.is_available():
            print("bench_verify_window: no CUDA device; use --small for the CPU plumbing check", file=sys.stderr)
            return 2
        device, dtype, cfg = "cuda", torch.bfloat16, Glm53Config.from_dict({"model_type": "glm_moe_dsa"})
    ks = list(range(1, args.max_k + 1))
    cases = []
    for context in contexts:
        for kind, routing in (("dense", None), ("moe", "random"), ("moe", "shared")):
            print(f"[bench_verify_window] {kind} {routing or ''} context {context}: k = 1..{args.max_k}", file=sys.stderr, flush=True)
            cases.append(bench_case(cfg, kind, routing, context, ks, args.reps, args.warmup, device, dtype, args.seed))
    print("[bench_verify_window] lm_head", file=sys.stderr, flush=True)
    cases.append(bench_head(cfg, ks, args.reps, args.warmup, device, dtype, args.seed))
    for case in cases:
        summarize(case)
    settings = {"dtype": str(dtype), "dims": "tiny" if args.small else "GLM-5.3 real", "contexts": contexts,
                "ks": ks, "reps": args.reps, "warmup": args.warmup, "ranks": 1, "dcp": 1,
                "experts": "DecodedExperts bf16 (not EXL3)", "mode": "decode (absorbed MLA)",
                "cuda_graphs": False, "timing": "CUDA events" if device == "cuda" else "wall clock"}
    result = {**result_header("verify_window", settings, device=device),
              "torch": torch.__version__, "triton": installed_version("triton"), "cuda": torch.version.cuda,
              "cases": cases}
    out = write_json(args.out, result)
    print(f"wrote {out}", file=sys.stderr)
    header = f"{'layer':<14}{'ctx':>7}" + "".join(f"{'k=' + str(k):>8}" for k in ks)
    print("ratio t(k)/t(1) (median); t(1) in us in the last column")
    print(header + f"{'t(1) us':>10}")
    for case in cases:
        name = case["kind"] + (f"/{case['routing']}" if case["routing"] else "")
        row = f"{name:<14}{case['context'] or '-':>7}" + "".join(f"{case['summary'][str(k)]['ratio_to_k1']:>8.2f}" for k in ks)
        print(row + f"{case['summary']['1']['median_us']:>10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
