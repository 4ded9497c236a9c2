"""The sparse-attention indexer (DSA): which cached positions each query attends to.

As the reference computes it: a query per indexer head from the q LoRA residual (wq_b), one key per
position (LayerNorm(wk x)), interleaved RoPE on the first qk_rope_head_dim dims of both; the score of
key t for query s is sum_h w_h(s) * relu(q_h(s) . k(t) / sqrt(d)), w = weights_proj(x) / sqrt(H),
all in fp32. Future positions are excluded; each query keeps its top `index_topk` positions (all of
its causal positions when it has fewer). 'shared' layers reuse the previous 'full' layer's selection.

Ties are broken toward the lower position, so the selection is a function of the scores alone
(the reference's torch.topk leaves tie order unspecified; exact ties have measure zero in fp32
unless every head's relu is zero for several keys).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from glm53.model.norm import INDEXER_KEY_NORM_EPS, layer_norm
from glm53.model.rope import apply_rope

QUERY_BLOCK = 256  # queries scored per block (bounds the [block, heads, keys] fp32 buffer)


@dataclass
class IndexerWeights:
    wq_b: torch.Tensor  # [heads * head_dim, q_lora_rank]
    wk: torch.Tensor  # [head_dim, hidden]
    k_norm_weight: torch.Tensor
    k_norm_bias: torch.Tensor
    weights_proj: torch.Tensor  # [heads, hidden], kept in fp32 like the reference
    n_heads: int
    head_dim: int
    rope_dim: int


def indexer_keys(w: IndexerWeights, x_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[T, head_dim] keys to cache, rope on the leading rope_dim values."""
    k = layer_norm(x_norm @ w.wk.T, w.k_norm_weight, w.k_norm_bias, INDEXER_KEY_NORM_EPS)
    return torch.cat([apply_rope(k[:, : w.rope_dim], cos, sin), k[:, w.rope_dim:]], dim=-1)


def indexer_queries(w: IndexerWeights, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    q = (q_resid @ w.wq_b.T).view(q_resid.shape[0], w.n_heads, w.head_dim)
    return torch.cat([apply_rope(q[..., : w.rope_dim], cos, sin), q[..., w.rope_dim:]], dim=-1)


def index_scores(w: IndexerWeights, q: torch.Tensor, x_norm: torch.Tensor, keys: torch.Tensor,
                 q_positions: torch.Tensor, key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """[Tq, Tk] fp32 scores of keys at key_positions (default [0, Tk); a DCP rank passes the
    positions it owns) for queries at q_positions; -inf where the key lies in the query's future."""
    head_weights = (x_norm.to(torch.float32) @ w.weights_proj.to(torch.float32).T) * (w.n_heads ** -0.5)
    keys32 = keys.to(torch.float32).T  # [D, Tk]
    scale = w.head_dim ** -0.5
    out = torch.empty(q.shape[0], keys.shape[0], dtype=torch.float32, device=q.device)
    for b in range(0, q.shape[0], QUERY_BLOCK):
        qb = q[b:b + QUERY_BLOCK].to(torch.float32)  # [B, H, D]
        per_head = torch.relu(torch.matmul(qb, keys32) * scale)  # [B, H, Tk]
        out[b:b + QUERY_BLOCK] = torch.matmul(head_weights[b:b + QUERY_BLOCK, None, :], per_head)[:, 0]
    if key_positions is None:
        key_positions = torch.arange(keys.shape[0], device=q.device)
    future = key_positions[None, :] > q_positions[:, None]
    return out.masked_fill(future, float("-inf"))


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask [Tq, Tk]: each row's k best finite scores, ties toward the lower position."""
    k_eff = min(k, scores.shape[-1])
    threshold = scores.topk(k_eff, dim=-1).values[:, -1:]
    above = scores > threshold
    room = k_eff - above.sum(dim=-1, keepdim=True)
    at = scores == threshold
    chosen = above | (at & (at.cumsum(dim=-1) <= room))
    return chosen & torch.isfinite(scores)
