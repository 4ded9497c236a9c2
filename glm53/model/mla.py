"""Multi-head latent attention (MLA) over the latent cache.

Per position the cache holds c = RMSNorm(kv_a(x)[:r]) (r = kv_lora_rank) and the roped shared key
k_rot (qk_rope_head_dim). kv_b maps c to per-head [k_nope | v]. The forward attends in the absorbed
(latent) form for prefill, decode and draft verification alike: q_lat = W_uk^T q_nope, each query
scores only its own selected rows (the indexer's top-k, or all its causal rows when it has fewer),
score = (q_lat . c + q_rot . k_rot) * scale, fp32 softmax, attended latent -> W_uv. Every step is
row-invariant (glm53.ops), so a query's output does not depend on the other queries of its forward:
resumed prefills, decode steps and verification windows compute the same bits as a cold prefill.

`attend_expanded` is the reference's formulation (keys expanded through kv_b, every key scored under
a mask); the model does not run it: tests and benchmarks check the absorbed path against it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from glm53 import ops
from glm53.model.indexer import Selection
from glm53.model.norm import LORA_NORM_EPS, rms_norm
from glm53.model.rope import apply_rope

HEAD_GROUP = 16  # heads per block in the expanded reference (bounds the [heads, Tq, Tk] fp32 buffer)


@dataclass
class AttentionWeights:
    """q_a, q_b, kv_a and o are dense [out, in] tensors or EXL3 linears (ops.project takes either);
    kv_b is dense (the absorbed form reads it per head)."""

    q_a: torch.Tensor  # [q_lora_rank, hidden]
    q_a_norm: torch.Tensor
    q_b: torch.Tensor  # [heads * (nope + rope), q_lora_rank]   (this rank's heads)
    kv_a: torch.Tensor  # [r + rope, hidden]
    kv_a_norm: torch.Tensor
    kv_b: torch.Tensor  # [heads * (nope + v), r]                (this rank's heads)
    o: torch.Tensor  # [hidden, heads * v]                      (this rank's heads)
    n_heads: int  # heads on this rank
    nope: int
    rope: int
    v_dim: int
    kv_rank: int
    scale: float

    def __post_init__(self) -> None:
        per_head = self.kv_b.view(self.n_heads, self.nope + self.v_dim, self.kv_rank)
        # head_linear operands [H, N, K]: q_lat[t, h] = w_uk_t[h] @ q_nope[t, h]; out[t, h] = w_uv[h] @ latent
        self.w_uk_t = per_head[:, : self.nope].transpose(1, 2).contiguous()  # [H, r, nope]
        self.w_uv = per_head[:, self.nope:].contiguous()  # [H, v, r]


def project_queries(w: AttentionWeights, x_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_resid [T, q_lora] (the indexer reuses it), q_nope [T, H, nope], q_rot [T, H, rope] (roped)."""
    q_resid = rms_norm(ops.project(x_norm, w.q_a), w.q_a_norm, LORA_NORM_EPS)
    q = ops.project(q_resid, w.q_b).view(x_norm.shape[0], w.n_heads, w.nope + w.rope)
    return q_resid, q[..., : w.nope], apply_rope(q[..., w.nope:], cos, sin)


def latent_rows(w: AttentionWeights, x_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[T, r + rope]: the rows to cache for these positions."""
    kv = ops.project(x_norm, w.kv_a)
    c = rms_norm(kv[:, : w.kv_rank], w.kv_a_norm, LORA_NORM_EPS)
    return torch.cat([c, apply_rope(kv[:, w.kv_rank:], cos, sin)], dim=-1)


def absorbed_queries(w: AttentionWeights, q_nope: torch.Tensor, q_rot: torch.Tensor) -> torch.Tensor:
    """[T, H, r + rope]: the latent-space query (W_uk^T q_nope | q_rot) every key row is scored with."""
    q_lat = ops.head_linear(q_nope, w.w_uk_t)
    return torch.cat([q_lat, q_rot.to(q_lat.dtype)], dim=-1)


def attend(w: AttentionWeights, q_nope: torch.Tensor, q_rot: torch.Tensor, rows: torch.Tensor,
           selection: Selection) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [T, H, *] over their selected cache rows (rows [n, r + rope]): (out [T, H, v], lse [T, H])."""
    latent, lse = ops.latent_attention(absorbed_queries(w, q_nope, q_rot), rows, selection.indices,
                                       selection.valid, w.scale, w.kv_rank, valid_prefix=True)
    return ops.head_linear(latent, w.w_uv), lse


def output_projection(w: AttentionWeights, attn: torch.Tensor) -> torch.Tensor:
    """[T, H, v] -> [T, hidden] partial sum over this rank's heads (row-parallel o_proj)."""
    return ops.project(attn.reshape(attn.shape[0], -1), w.o)


def attend_expanded(w: AttentionWeights, q_nope: torch.Tensor, q_rot: torch.Tensor, cached: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's formulation: queries [Tq, H, *] over cached rows [Tk, r + rope] with mask [Tq, Tk]
    -> ([Tq, H, v], [Tq, H]); a row with no allowed key returns zeros and lse = -inf."""
    kv = (cached[:, : w.kv_rank] @ w.kv_b.T).view(cached.shape[0], w.n_heads, w.nope + w.v_dim)
    k_rot = cached[:, w.kv_rank:]
    outs, lses = [], []
    for h in range(0, w.n_heads, HEAD_GROUP):
        hs = slice(h, h + HEAD_GROUP)
        q = torch.cat([q_nope[:, hs], q_rot[:, hs]], dim=-1).transpose(0, 1)  # [g, Tq, nope+rope]
        k_nope = kv[:, hs, : w.nope].transpose(0, 1)  # [g, Tk, nope]
        k = torch.cat([k_nope, k_rot[None].expand(k_nope.shape[0], -1, -1)], dim=-1)
        v = kv[:, hs, w.nope:].transpose(0, 1)  # [g, Tk, v]
        scores = torch.matmul(q, k.transpose(1, 2)).to(torch.float32) * w.scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        probs = torch.exp(scores - safe[..., None])
        outs.append(torch.matmul(probs.to(q.dtype), v))
        lses.append(lse)
    return torch.cat(outs, 0).transpose(0, 1), torch.cat(lses, 0).transpose(0, 1)
