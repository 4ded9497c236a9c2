"""KV bytes per rank at 1,048,576 tokens, and bytes each rank sends per decode step, at GLM-5.3's dimensions.

    python -m bench.bench_kv_bytes [--out results/kv_bytes.json] [--context 1048576] [--check-tokens 4099]

1. KV bytes per rank (R = 1, 3, 4; DCP on and off; bf16 and fp8) from glm53.layout.kv (the plan's
   KV function), checked against an actual allocation at small scale: per rank, a real
   glm53.model.kv_state.KVState with all 78 layers' tensors, sized to the positions that rank owns
   (glm53.dist.dcp.Ownership), whose tensor bytes must equal the formula exactly (bf16 and fp8:
   fp8 is 576 e4m3 values plus one fp32 scale per row, as glm53.model.kv_state allocates).
2. Bytes sent per decode step per rank (one token), from the real messages glm53.dist builds:
   the tensors are constructed at real size and their nbytes taken, then multiplied by what the
   collective sends per rank (all-gather of m bytes: (R-1) m; ring all-reduce: 2 (R-1)/R m).
   Per layer: attention o_proj sum + MLP/MoE sum (hidden, TP), the DCP query gather (this rank's
   heads' absorbed queries), the DCP merge (latent out + lse, fp32: all heads by all-gather, or own
   heads only by all-to-all), the top-k
   key gather on full-indexer layers; per step: the embedding sum and the logits gather.
Exit 0 when every allocation check holds, 1 when one does not.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.lib.meta import KIT_ROOT, result_header
from glm53.measurement import write_json
from glm53.config import Glm53Config
from glm53.dist import dcp, tp
from glm53.model.kv_state import KVState
from glm53.layout.kv import kv_bytes_per_rank

RANKS = (1, 3, 4)
GIB = 1 << 30


def real_config() -> Glm53Config:
    """GLM-5.3 dimensions (glm53.config defaults), schedules resolved as for a config.json without
    indexer_types (every layer runs its own indexer: the upper bound for indexer keys)."""
    return Glm53Config.from_dict({"model_type": "glm_moe_dsa"}, source="GLM-5.3 defaults")


def allocated_bytes(cfg: Glm53Config, tokens: int, ranks: int, rank: int, kv_dtype: str, dcp_on: bool) -> int:
    own = dcp.Ownership.for_rank(rank, ranks, enabled=dcp_on)
    n = own.count(tokens)
    indexed = frozenset(i for i in range(cfg.num_hidden_layers) if cfg.indexer_is_full(i))
    state = KVState(n_layers=cfg.num_hidden_layers, latent_dim=cfg.latent_dim, index_dim=cfg.index_head_dim,
                    indexed_layers=indexed, kv_dtype=kv_dtype)
    state.reserve(n)
    if state.capacity != n:
        raise SystemExit(f"KVState reserved {state.capacity} rows for {n}; use --check-tokens >= {256 * max(RANKS)}")
    tensors = [*state.latent, *state.latent_scale, *state.index_keys.values(), *state.index_scale.values()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def decode_messages(cfg: Glm53Config, ranks: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, dict]:
    """Per-rank bytes sent in one decode step, by message kind."""
    R = ranks
    if R == 1:
        return {}
    heads_max = max(b - a for a, b in tp.head_ranges(cfg.num_attention_heads, R))
    hidden = torch.empty(1, cfg.hidden_size, dtype=dtype)
    q_heads = torch.empty(1, heads_max, cfg.latent_dim, dtype=dtype)  # absorbed q (latent + rope) of own heads
    merge = torch.empty(cfg.num_attention_heads, cfg.kv_lora_rank + 1, dtype=torch.float32)  # dcp_merge's packing
    keys = dcp.local_topk_keys(torch.zeros(1, cfg.index_topk), torch.arange(cfg.index_topk), cfg.index_topk)
    vocab_max = max(b - a for a, b in tp.vocab_ranges(cfg.vocab_size, R))
    logits = torch.empty(1, vocab_max, dtype=torch.float32)
    layers = cfg.num_hidden_layers
    full = sum(1 for i in range(layers) if cfg.indexer_is_full(i))
    gather = R - 1  # an all-gather sends its m bytes to each of the R-1 peers (ring: R-1 steps of m)
    ring = 2 * (R - 1) / R

    def row(m: int, per_step: int, how: str, factor: float) -> dict:
        return {"message_bytes": m, "per_step": per_step, "collective": how, "sent_per_step": int(m * per_step * factor)}

    return {
        "tp_sum_rank_order": row(hidden.nbytes, 2 * layers + 1, "all-gather (sum in rank order)", gather),
        "tp_sum_ring_allreduce": row(hidden.nbytes, 2 * layers + 1, "ring all-reduce (alternative)", ring),
        "dcp_query_gather": row(q_heads.nbytes, layers, "all-gather", gather),
        "dcp_merge_gather": row(merge.nbytes, layers, "all-gather (dcp_merge)", gather),
        "dcp_merge_to_owners": row(heads_max * (cfg.kv_lora_rank + 1) * 4, layers,
                                   "all-to-all (dcp_merge_to_owners)", R - 1),
        "topk_key_gather": row(keys.nbytes, full, "all-gather", gather),
        "logits_gather": row(logits.nbytes, 1, "all-gather", gather),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=1 << 20)
    parser.add_argument("--check-tokens", type=int, default=4099, help="context of the real allocation check")
    parser.add_argument("--out", type=Path, default=KIT_ROOT / "results" / "kv_bytes.json")
    args = parser.parse_args()
    cfg = real_config()

    kv_rows, checks, ok = [], [], True
    for kv_dtype in ("bf16", "fp8"):
        for dcp_on in (True, False):
            for R in RANKS:
                per_rank = kv_bytes_per_rank(cfg, args.context, R, dcp=dcp_on, kv_dtype=kv_dtype)
                kv_rows.append({"kv_dtype": kv_dtype, "dcp": dcp_on, "ranks": R, "context": args.context,
                                "bytes_per_rank": per_rank, "max_gib": max(per_rank) / GIB})
                formula = kv_bytes_per_rank(cfg, args.check_tokens, R, dcp=dcp_on, kv_dtype=kv_dtype)
                alloc = [allocated_bytes(cfg, args.check_tokens, R, r, kv_dtype, dcp_on) for r in range(R)]
                equal = alloc == formula
                if not equal:
                    ok = False
                checks.append({"kv_dtype": kv_dtype, "dcp": dcp_on, "ranks": R, "tokens": args.check_tokens,
                               "formula": formula, "allocated": alloc, "equal": equal})
    sends = {R: decode_messages(cfg, R) for R in RANKS}

    settings = {"context": args.context, "check_tokens": args.check_tokens, "layers": cfg.num_hidden_layers,
                "latent_dim": cfg.latent_dim, "index_head_dim": cfg.index_head_dim,
                "full_indexer_layers": sum(1 for i in range(cfg.num_hidden_layers) if cfg.indexer_is_full(i)),
                "mtp_layers": cfg.num_mtp_layers, "activation_dtype": "bf16"}
    result = {**result_header("kv_bytes", settings, device="cpu"), "torch": torch.__version__,
              "kv_per_rank": kv_rows, "allocation_checks": checks, "decode_bytes_sent_per_rank": sends,
              "note": "computed (no timing): one sample per number"}
    write_json(args.out, result)

    print(f"KV cache per rank at {args.context:,} tokens (GiB, the largest rank), {cfg.num_hidden_layers} layers:")
    print(f"{'kv dtype':<9}{'DCP':<5}" + "".join(f"{'R=' + str(R):>10}" for R in RANKS))
    for kv_dtype in ("bf16", "fp8"):
        for dcp_on in (True, False):
            cells = [r["max_gib"] for r in kv_rows if r["kv_dtype"] == kv_dtype and r["dcp"] == dcp_on]
            print(f"{kv_dtype:<9}{'on' if dcp_on else 'off':<5}" + "".join(f"{c:>10.2f}" for c in cells))
    print(f"\nallocation check at {args.check_tokens} tokens (KVState tensors vs glm53.layout.kv):")
    for c in checks:
        print(f"  {c['kv_dtype']:<5} DCP {'on ' if c['dcp'] else 'off'} R={c['ranks']}: "
              f"{'equal' if c['equal'] else 'DIFFERENT'}  formula {c['formula']}  allocated {c['allocated']}")
    print("\nbytes sent per decode step per rank (one token, bf16 activations):")
    print(f"{'message':<24}{'collective':<32}" + "".join(f"{'R=' + str(R):>12}" for R in RANKS[1:]))
    for kind in sends[RANKS[1]]:
        print(f"{kind:<24}{sends[RANKS[1]][kind]['collective']:<32}"
              + "".join(f"{sends[R][kind]['sent_per_step']:>12,}" for R in RANKS[1:]))
    chosen = ("tp_sum_rank_order", "dcp_query_gather", "dcp_merge_to_owners", "topk_key_gather", "logits_gather")
    total = {R: sum(sends[R][k]["sent_per_step"] for k in chosen) for R in RANKS[1:]}
    print(f"{'total (rank-order sums, merge by all-to-all)':<56}" + "".join(f"{total[R]:>12,}" for R in RANKS[1:]))
    print(f"\nJSON: {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
