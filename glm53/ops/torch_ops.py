"""The row-invariant ops in plain torch: the CPU path, and the reference the Triton kernels are checked against.

Matrix products pad their rows to a multiple of ROW_PAD (8) and the weight's rows (the output
columns) to a multiple of COL_PAD (16): MKL's fp32 GEMM gives a row different bits when it sits in a
product of fewer rows (1 takes the GEMV path; 2 and 3 differ too, or change with the thread count)
or of fewer than 16 columns, and the same bits for any row count that is a multiple of 4 or 8 and
any column count that is a multiple of 16 (tests/test_row_invariance.py sweeps shapes, counts,
offsets and threads; AVX2 here; the first session saw counts 1..7 differ on AVX-512). 8 rather
than 16 halves the waste of a decode step's products. Everything else here reduces along a row with the same length
whatever the row count (torch's CPU reductions are sequential per row), or is elementwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_PAD = 8  # rows of every CPU matrix product are padded to a multiple of this
COL_PAD = 16  # and its output columns (the weight's rows) to a multiple of this
QUERY_BLOCK = 256  # queries gathered per block in latent_attention (bounds the [block, k, D] gather)


def _pad_rows(x: torch.Tensor, multiple: int = ROW_PAD) -> torch.Tensor:
    pad = (-x.shape[0]) % multiple
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) if pad else x


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    m, n = flat.shape[0], w.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    # fewer than 16 output columns take another kernel too (seen with the indexer's few keys)
    return (_pad_rows(flat) @ _pad_rows(w, COL_PAD).T)[:m, :n].reshape(*lead, n)


def head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    t = x.shape[0]
    if t == 0:
        return x.new_empty(0, w.shape[0], w.shape[1])
    # per head a [T_pad, K] x [K, N] product: the same shape whatever T, like `linear`
    out = torch.matmul(_pad_rows(x).transpose(0, 1), w.transpose(1, 2))  # [H, T_pad, N]
    return out.transpose(0, 1)[:t]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def index_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    q32, k32 = q.to(torch.float32), _pad_rows(keys.to(torch.float32), COL_PAD)  # padded once, not per head
    out = torch.zeros(q.shape[0], keys.shape[0], dtype=torch.float32, device=q.device)
    if q.shape[0] == 0 or keys.shape[0] == 0:
        return out
    hw = head_weights.to(torch.float32)
    for h in range(q.shape[1]):  # heads summed one at a time, in order: no reduction tree over heads
        out += torch.relu(linear(q32[:, h], k32)[:, :keys.shape[0]] * scale) * hw[:, h, None]
    return out


def latent_attention(q: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor,
                     scale: float, value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    t, n_heads = q.shape[0], q.shape[1]
    if indices.shape != valid.shape or indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(f"indices {tuple(indices.shape)} and valid {tuple(valid.shape)} must both be [T={t}, k]")
    out = torch.zeros(t, n_heads, value_dim, dtype=q.dtype, device=q.device)
    lse = torch.full((t, n_heads), float("-inf"), dtype=torch.float32, device=q.device)
    if t == 0 or rows.shape[0] == 0 or indices.shape[1] == 0:
        return out, lse
    for b in range(0, t, QUERY_BLOCK):
        blk = slice(b, b + QUERY_BLOCK)
        # [B, k, D]: every query its own k rows (fixed width k), so each batch element of the two
        # products below has the same shape whatever B is
        picked = rows[indices[blk]].to(q.dtype)
        scores = torch.matmul(q[blk], picked.transpose(1, 2)).to(torch.float32) * scale  # [B, H, k]
        scores = scores.masked_fill(~valid[blk, None, :], float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)
        safe = torch.where(torch.isfinite(block_lse), block_lse, torch.zeros_like(block_lse))
        probs = torch.exp(scores - safe[..., None]).to(q.dtype)
        out[blk] = torch.matmul(probs, picked[..., :value_dim])
        lse[blk] = block_lse
    return out, lse
