"""Multi-head latent attention (MLA) over the latent cache.

Per position the cache holds c = RMSNorm(kv_a(x)[:r]) (r = kv_lora_rank) and the roped shared key
k_rot (qk_rope_head_dim). kv_b maps c to per-head [k_nope | v]. Two ways to attend:

- prefill (`attend_expanded`): expand the cached latents through kv_b into per-head keys/values and
  attend as the reference does (cheaper for many queries);
- decode (`attend_absorbed`): fold kv_b's nope part into the query (q_lat = W_uk^T q_nope), score
  against the latents directly, and map the attended latent through kv_b's v part (W_uv).

Both return per-head outputs and the log-sum-exp of the scores, so a context-parallel layout can
merge partial attentions (RankPlan.attend; glm53.dist.dcp.tp_dcp_attention).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from glm53.model.norm import LORA_NORM_EPS, rms_norm
from glm53.model.rope import apply_rope

HEAD_GROUP = 16  # heads per block in the expanded path (bounds the [heads, Tq, Tk] fp32 buffer)


@dataclass
class AttentionWeights:
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
        self.w_uk = per_head[:, : self.nope]  # [H, nope, r]
        self.w_uv = per_head[:, self.nope:]  # [H, v, r]


def project_queries(w: AttentionWeights, x_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_resid [T, q_lora] (the indexer reuses it), q_nope [T, H, nope], q_rot [T, H, rope] (roped)."""
    q_resid = rms_norm(x_norm @ w.q_a.T, w.q_a_norm, LORA_NORM_EPS)
    q = (q_resid @ w.q_b.T).view(x_norm.shape[0], w.n_heads, w.nope + w.rope)
    return q_resid, q[..., : w.nope], apply_rope(q[..., w.nope:], cos, sin)


def latent_rows(w: AttentionWeights, x_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[T, r + rope]: the rows to cache for these positions."""
    kv = x_norm @ w.kv_a.T
    c = rms_norm(kv[:, : w.kv_rank], w.kv_a_norm, LORA_NORM_EPS)
    return torch.cat([c, apply_rope(kv[:, w.kv_rank:], cos, sin)], dim=-1)


def _softmax_attend(scores: torch.Tensor, mask: torch.Tensor, values: torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [..., Tq, Tk] fp32, mask broadcastable bool, values [..., Tk, d] -> (out, lse).
    A row with no allowed key returns zeros and lse = -inf (never NaN)."""
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe[..., None])
    return torch.matmul(probs.to(dtype), values), lse


def attend_expanded(w: AttentionWeights, q_nope: torch.Tensor, q_rot: torch.Tensor, cached: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [Tq, H, *] over cached rows [Tk, r + rope] with mask [Tq, Tk] -> ([Tq, H, v], [Tq, H])."""
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
        out, lse = _softmax_attend(scores, mask[None], v, q.dtype)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 0).transpose(0, 1), torch.cat(lses, 0).transpose(0, 1)


def attend_absorbed(w: AttentionWeights, q_nope: torch.Tensor, q_rot: torch.Tensor, cached: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as attend_expanded, computed in the latent space (decode, draft verification)."""
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w.w_uk)  # [Tq, H, r]
    c, k_rot = cached[:, : w.kv_rank], cached[:, w.kv_rank:]
    scores = (torch.einsum("thr,kr->htk", q_lat, c) + torch.einsum("thp,kp->htk", q_rot, k_rot))
    scores = scores.to(torch.float32) * w.scale
    attended, lse = _softmax_attend(scores, mask[None], c[None].expand(w.n_heads, -1, -1), q_lat.dtype)  # [H, Tq, r]
    out = torch.einsum("htr,hvr->thv", attended, w.w_uv)
    return out, lse.transpose(0, 1)


def attend_decode(w: AttentionWeights, q_nope: torch.Tensor, q_rot: torch.Tensor, cached: torch.Tensor,
                  selection: torch.Tensor, gather_above: int) -> tuple[torch.Tensor, torch.Tensor]:
    """attend_absorbed; a single query over more than `gather_above` rows (the indexer's top-k)
    gathers its selected rows (ascending) first instead of masking all of them."""
    if q_nope.shape[0] == 1 and cached.shape[0] > gather_above:
        picked = selection[0].nonzero().squeeze(1)
        return attend_absorbed(w, q_nope, q_rot, cached[picked],
                               torch.ones(1, picked.shape[0], dtype=torch.bool, device=cached.device))
    return attend_absorbed(w, q_nope, q_rot, cached, selection)


def output_projection(w: AttentionWeights, attn: torch.Tensor) -> torch.Tensor:
    """[T, H, v] -> [T, hidden] partial sum over this rank's heads (row-parallel o_proj)."""
    return attn.reshape(attn.shape[0], -1) @ w.o.T
