"""The row-invariant ops in plain torch: the CPU path, and the reference the Triton kernels are checked against.

MKL's fp32 GEMM gives a row different bits with the row count (1 row takes the GEMV path; 2 to 7
rows differ from the same rows in a larger product, or change with the thread count) and with the
column count below 16. So:

- `linear` and `head_linear` run every row as its own one-row product (one batched call of M
  one-row products: MKL's GEMV kernel for each, in fp32, never a batch of one: `_row_products`), the
  same instructions whatever M is, and the cheapest form for a decode step. Their weights never
  change shape, so column counts do not matter.
- `index_scores` multiplies queries by a growing set of keys, so it needs invariance in both counts.
  Each query is its own product of its heads by the keys ([heads, d] @ [d, keys]: the heads, a
  model constant, are the rows, so a score's row in its product never moves), batched over the
  queries like `_row_products`, and keys are padded to a multiple of COL_PAD (16). One GEMM of all
  queries padded to a multiple of 8 changes bits under MKL's AVX2 kernels (MKL_ENABLE_INSTRUCTIONS=AVX2
  on an AVX-512 host): a query's row in the product moves with the query count and offset. This form
  costs 1.1-1.7x that GEMM on the CPU (bench/bench_index_scores.py; docs/decisions/row-invariant-ops.md).

tests/test_row_invariance.py sweeps shapes, counts, offsets and threads; it passes on an AVX2 host
and on an AVX-512 + AMX host (where a lone one-row fp32 product is split over two threads and a
one-row bf16 head projection changes bits, which `_matmul32` avoids), and on the latter with MKL held
to its AVX2 or SSE4.2 kernels. Everything else here reduces along a row with the same length whatever the
row count (torch's CPU reductions are sequential per row), or is elementwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

COL_PAD = 16  # index_scores: keys padded to a multiple of this
INDEX_BLOCK_FLOATS = 1 << 24  # index_scores: queries per product bounded so [queries, heads, keys] fits this
QUERY_BLOCK = 256  # queries gathered per block in latent_attention (bounds the [block, k, D] gather)


def _settle_mkl_vml() -> None:
    """One exp on one element, in this thread, before any parallel one. MKL's vector math (torch's
    CPU exp, log, tanh on contiguous float tensors) initialises itself at its first call; when that
    call comes from two of torch's threads at once, one thread's share of the tensor is computed at
    about 12-bit accuracy (relative error 1.5e-4 where 6e-8 is normal; measured on an AVX-512 + AMX
    host, torch 2.13, MKL 2024.2, in 5-50% of fresh processes, whole halves of the tensor). A first
    call from one thread initialises it for all: tests/test_row_invariance.py, the fresh-process test."""
    torch.exp(torch.zeros(1))


_settle_mkl_vml()


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[0]) % multiple
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) if pad else x


def _matmul32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched torch.matmul ([B, M, K] @ [B, K, N]); on the CPU, batch elements get the same bits
    whatever B is, the thread count, or what ran before, computed in fp32 (a bf16 product is exact in fp32,
    so this is the ops' fp32 accumulation). Two dispatches inside torch/MKL differ with the batch
    (both measured on an AVX-512 + AMX host, torch 2.13): a batch of one runs as one product spread
    over the threads (fp32 GEMV rows at N = 1900, and attention's per-query products once the thread
    count had been set, changed bits), so it goes as two, both operands broadcast; and bf16 batched
    products go to oneDNN only above a size threshold on the whole call (B * M * K * N > 16^3), to
    torch's own loops below it (one-row bf16 head projections changed bits), so none stay bf16."""
    if a.device.type != "cpu":  # CUDA's torch path (debugging) is not row-invariant anyway
        return torch.matmul(a, b)
    a, b = a.to(torch.float32), b.to(torch.float32)
    if a.shape[0] == 1:
        return torch.matmul(a.expand(2, *a.shape[1:]), b.expand(2, *b.shape[1:]))[:1]
    return torch.matmul(a, b)


def _row_products(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out[r] = x[r] @ w[r] for x [M, K], w [M, K, N] -> [M, N] in x's dtype: M one-row products in
    one batched call (MKL's GEMV for each)."""
    return _matmul32(x[:, None, :], w)[:, 0].to(x.dtype)


def _one_row_products(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T as M one-row products (w broadcast, not copied), in x's dtype."""
    m, k = x.shape
    return _row_products(x, w.T.expand(m, k, w.shape[0]))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    if flat.shape[0] == 0:
        return x.new_empty(*lead, w.shape[0])
    return _one_row_products(flat, w).reshape(*lead, w.shape[0])


def expert_linear(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # each row its own one-row product with its expert's matrix, laid out as linear() lays w out
    if x.shape[0] == 0:
        return x.new_empty(0, w.shape[1])
    return _row_products(x, w[ids].transpose(1, 2))


def head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 0:
        return x.new_empty(0, w.shape[0], w.shape[1])
    return torch.stack([_one_row_products(x[:, h], w[h]) for h in range(x.shape[1])], dim=1)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    # through exp: torch's CPU sigmoid and silu compute vector lanes and the scalar tail differently
    # (measured: the same value, other bits, in a 1-row and a 20-row tensor); exp does not
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def check_positions(t: int, n: int, q_positions: torch.Tensor | None, key_positions: torch.Tensor | None) -> None:
    """index_scores' optional positions: q_positions [T] turns the causal mask on; key_positions [N]
    (default 0..N-1) only with it."""
    if q_positions is None and key_positions is not None:
        raise ValueError("index_scores: key_positions given without q_positions: pass the queries' positions "
                         "too (the mask compares the two)")
    if q_positions is not None and q_positions.shape != (t,):
        raise ValueError(f"index_scores: q_positions {tuple(q_positions.shape)} must be [T={t}], one per query")
    if key_positions is not None and key_positions.shape != (n,):
        raise ValueError(f"index_scores: key_positions {tuple(key_positions.shape)} must be [N={n}], one per key")


def index_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, scale: float,
                 q_positions: torch.Tensor | None = None, key_positions: torch.Tensor | None = None) -> torch.Tensor:
    check_positions(q.shape[0], keys.shape[0], q_positions, key_positions)
    out = _index_scores(q, head_weights, keys, scale)
    if q_positions is None:
        return out
    if key_positions is None:
        key_positions = torch.arange(keys.shape[0], device=q.device)
    return out.masked_fill(key_positions[None, :] > q_positions[:, None], float("-inf"))


def _index_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    m, n, heads = q.shape[0], keys.shape[0], q.shape[1]
    out = torch.zeros(m, n, dtype=torch.float32, device=q.device)
    if m == 0 or n == 0:
        return out
    kt = _pad_rows(keys.to(torch.float32), COL_PAD).T  # once, not per block
    q32, hw = q.to(torch.float32), head_weights.to(torch.float32)
    step = max(1, INDEX_BLOCK_FLOATS // (heads * kt.shape[1]))
    for a in range(0, m, step):
        b = min(m, a + step)
        scores = _matmul32(q32[a:b], kt.expand(b - a, *kt.shape))[..., :n]  # [queries, heads, keys]
        block = out[a:b]
        for h in range(heads):  # heads summed one at a time, in order: no reduction tree over heads
            block += torch.relu(scores[:, h] * scale) * hw[a:b, h, None]
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
        scores = _matmul32(q[blk], picked.transpose(1, 2)).to(torch.float32) * scale  # [B, H, k]
        scores = scores.masked_fill(~valid[blk, None, :], float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)
        safe = torch.where(torch.isfinite(block_lse), block_lse, torch.zeros_like(block_lse))
        probs = torch.exp(scores - safe[..., None]).to(q.dtype)
        out[blk] = _matmul32(probs, picked[..., :value_dim]).to(q.dtype)
        lse[blk] = block_lse
    return out, lse
