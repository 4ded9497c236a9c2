"""Sparse prefill attention: each query attends only to its indexer-selected rows, in the latent space.

`attend_expanded` (mla.py) expands every cached row through kv_b and scores every query against every
key, with the top-k applied as a mask; its cost per chunk grows with the history Tk. Here each query
gathers its (at most k) selected latent rows, ascending by position and padded to exactly k with a
masked dummy, and attends in the absorbed form (q_lat = W_uk^T q_nope; score = q_lat.c + q_rot.k_rot,
scaled, fp32 softmax; attended latent -> W_uv). Per chunk the work is O(Tq * k), whatever Tk is,
apart from the index bookkeeping (mask -> indices reads the [Tq, Tk] mask; `topk_indices` avoids
the mask and costs one topk over the indexer's scores, which are O(Tq * Tk) to compute anyway).

Numerics: a query's result is a function of its q and its selected rows only (fixed width k, fixed
order), so it does not depend on Tk, on rows it did not select, or on the chunking of the grid. Same
contract as mla.attend_expanded / attend_absorbed: (out [Tq, H, v], lse [Tq, H]); a query with no
selected row gets out 0 and lse = -inf, never NaN.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from glm53.model.mla import AttentionWeights

QUERY_BLOCK = 256  # queries gathered per block: bounds the [block, k, r + rope] gather and [block, H, k] scores


def mask_to_indices(selection: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool selection [Tq, Tk] with at most k True a row -> (indices [Tq, k] int64 ascending, valid [Tq, k]).
    Padding slots hold index 0 and valid False."""
    if selection.dtype != torch.bool or selection.dim() != 2:
        raise ValueError(f"selection must be a bool [Tq, Tk] mask, got {selection.dtype} {tuple(selection.shape)}")
    tq, tk = selection.shape
    if k < 1:
        raise ValueError(f"k (index_topk) must be >= 1, got {k}")
    counts = selection.sum(dim=1)
    if tq and tk and int(counts.max()) > k:
        raise ValueError(f"selection has a row with {int(counts.max())} selected keys, more than k={k}; "
                         "pass the indexer's index_topk as k")
    indices = torch.zeros(tq, k, dtype=torch.long, device=selection.device)
    valid = torch.zeros(tq, k, dtype=torch.bool, device=selection.device)
    if tq == 0 or tk == 0:
        return indices, valid
    # Distinct keys (Tk - position) for selected columns, 0 elsewhere: the top min(k, Tk) are the
    # selected positions in ascending order, then the unselected (key 0) ones.
    width = min(k, tk)
    positions = torch.arange(tk, 0, -1, device=selection.device, dtype=torch.int32)
    keys = torch.where(selection, positions[None, :], torch.zeros((), dtype=torch.int32, device=selection.device))
    top = keys.topk(width, dim=1, sorted=True).values.to(torch.long)
    valid[:, :width] = top > 0
    indices[:, :width] = torch.where(valid[:, :width], tk - top, torch.zeros_like(top))
    return indices, valid


def topk_indices(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The set indexer.select_topk(scores, k) selects, as (indices [Tq, k] ascending, valid [Tq, k]),
    without building the [Tq, Tk] mask: k best finite scores per row, ties toward the lower position.
    Ties are made impossible by sorting on (score, -position) packed into one int64."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 [Tq, Tk] (indexer.index_scores), got {scores.dtype} {tuple(scores.shape)}")
    tq, tk = scores.shape
    indices = torch.zeros(tq, k, dtype=torch.long, device=scores.device)
    valid = torch.zeros(tq, k, dtype=torch.bool, device=scores.device)
    if tq == 0 or tk == 0:
        return indices, valid
    if torch.isnan(scores).any():
        raise ValueError("indexer scores contain NaN; the selection is undefined")
    width = min(k, tk)
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0 (select_topk compares them equal)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.long)  # int order == float order
    tie_break = torch.arange(tk - 1, -1, -1, device=scores.device, dtype=torch.long)  # lower position wins
    chosen = (ordered * (1 << 32) + tie_break[None, :]).topk(width, dim=1, sorted=False).indices
    finite = torch.isfinite(scores.gather(1, chosen))
    chosen = torch.where(finite, chosen, torch.full_like(chosen, tk))  # sentinel sorts last
    chosen = chosen.sort(dim=1).values
    valid[:, :width] = chosen < tk
    indices[:, :width] = torch.where(valid[:, :width], chosen, torch.zeros_like(chosen))
    return indices, valid


def attend_sparse_indices(w: "AttentionWeights", q_nope: torch.Tensor, q_rot: torch.Tensor, cached: torch.Tensor,
                          indices: torch.Tensor, valid: torch.Tensor, *, query_block: int = QUERY_BLOCK
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [Tq, H, nope] / [Tq, H, rope] over rows cached[indices[t, j]] where valid[t, j]
    -> (out [Tq, H, v], lse [Tq, H] fp32). indices/valid [Tq, k] as from mask_to_indices / topk_indices."""
    tq, n_heads = q_nope.shape[0], q_nope.shape[1]
    if indices.shape != valid.shape or indices.dim() != 2 or indices.shape[0] != tq:
        raise ValueError(f"indices {tuple(indices.shape)} and valid {tuple(valid.shape)} must both be [Tq={tq}, k]")
    if query_block < 1:
        raise ValueError(f"query_block must be >= 1, got {query_block}")
    r = w.kv_rank
    dtype = q_nope.dtype
    out = torch.zeros(tq, n_heads, w.v_dim, dtype=dtype, device=q_nope.device)
    lse = torch.full((tq, n_heads), float("-inf"), dtype=torch.float32, device=q_nope.device)
    if tq == 0 or cached.shape[0] == 0 or indices.shape[1] == 0:
        return out, lse
    # Whole-chunk projections, outside the query blocks, so query_block cannot change their bits.
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w.w_uk)  # [Tq, H, r]
    q_full = torch.cat([q_lat, q_rot.to(q_lat.dtype)], dim=-1)  # [Tq, H, r + rope]
    attended = torch.empty(tq, n_heads, r, dtype=q_lat.dtype, device=q_lat.device)
    for b in range(0, tq, query_block):
        blk = slice(b, b + query_block)
        rows = cached[indices[blk]].to(q_lat.dtype)  # [B, k, r + rope]: the only Tk-dependent step (indexing)
        scores = torch.matmul(q_full[blk], rows.transpose(1, 2)).to(torch.float32) * w.scale  # [B, H, k]
        scores = scores.masked_fill(~valid[blk, None, :], float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)
        safe = torch.where(torch.isfinite(block_lse), block_lse, torch.zeros_like(block_lse))
        probs = torch.exp(scores - safe[..., None]).to(q_lat.dtype)
        attended[blk] = torch.matmul(probs, rows[..., :r])  # [B, H, r]
        lse[blk] = block_lse
    out = torch.einsum("thr,hvr->thv", attended, w.w_uv)
    return out, lse


def attend_sparse_prefill(w: "AttentionWeights", q_nope: torch.Tensor, q_rot: torch.Tensor, cached: torch.Tensor,
                          selection: torch.Tensor, k: int, *, query_block: int = QUERY_BLOCK
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for mla.attend_expanded(w, q_nope, q_rot, cached, selection) when every row of the bool
    selection [Tq, Tk] has at most k True (the indexer's top-k): (out [Tq, H, v], lse [Tq, H])."""
    if selection.shape != (q_nope.shape[0], cached.shape[0]):
        raise ValueError(f"selection {tuple(selection.shape)} must be [Tq={q_nope.shape[0]}, Tk={cached.shape[0]}]")
    indices, valid = mask_to_indices(selection, k)
    return attend_sparse_indices(w, q_nope, q_rot, cached, indices, valid, query_block=query_block)
