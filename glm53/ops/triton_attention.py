"""Absorbed MLA over each query's own selected latent rows on CUDA (Triton), row-invariant by construction.

Grid: (query t, block of BLOCK_H heads). A program holds its heads' q [BLOCK_H, D] and walks the
query's k selection slots in blocks of BLOCK_N in ascending slot order, gathering rows[indices[t, j]]
(masked by valid, so an invalid slot's index is never dereferenced), with an online softmax: running
max m, sum l and fp32 accumulator [BLOCK_H, value_dim]. D is split into the value part [0, value_dim)
and the rest (GLM-5.3: 512 latent + 64 rope; the tiny model: 64 + 16), each padded to a power of two
with masks. Invariance: one program sees one query only, its loop runs over that query's slots in a
fixed order with a config from (H, D, value_dim, dtype) alone (T and k are do_not_specialize), so
neither T nor the query's position changes its bits. A block with no valid slot is an exact no-op
(alpha = 1, p = 0), so invalid trailing slots (a wider k) change nothing, and the loop stops after
the block holding the query's last valid slot: the same bits, without the work (a short context, a
DCP rank that owns a quarter of the selection). No valid slot at all gives out 0 and lse -inf,
never NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def attention_config(heads: int, d: int, value_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages) from the fixed dims only."""
    block_h = max(16, min(64, triton.next_power_of_2(heads)))  # tl.dot needs >= 16 rows
    if dtype == torch.float32:
        return min(block_h, 16), 16, 4, 1
    # all 64 heads of a query share its gathered rows: one program per query reads each row once
    # H200, T=2048 H=64 k=2048 D=576: 2.9 ms, 255 registers, no spills (3 stages spill: 3.7 ms;
    # BLOCK_N 32: 4.1 ms; BLOCK_H 32: 7.7 ms); BLOCK_N 128 runs out of shared memory
    return block_h, 64, 8, 2


@triton.jit(do_not_specialize=["T", "K_SLOTS"])
def _latent_attention_kernel(q_ptr, rows_ptr, idx_ptr, valid_ptr, end_ptr, out_ptr, lse_ptr, T, K_SLOTS, H, scale,
                             stride_qt, stride_qh, stride_r, stride_it, stride_vt, stride_ot, stride_oh, stride_lt,
                             DV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
                             BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    h_mask = offs_h < H
    v_mask = offs_v < DV
    r_mask = offs_r < DR

    q_base = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    q_v = tl.load(q_base + offs_v[None, :], mask=h_mask[:, None] & v_mask[None, :], other=0.0)
    if DR > 0:
        q_r = tl.load(q_base + DV + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)

    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), dtype=tl.float32)
    end = tl.load(end_ptr + t)  # one past the query's last valid slot: later blocks are no-ops
    for jb in range(0, tl.cdiv(end, BLOCK_N)):  # slots in ascending order, fixed blocks
        offs_j = jb * BLOCK_N + tl.arange(0, BLOCK_N)
        in_range = offs_j < K_SLOTS
        # idx and valid load side by side (the gather waits on both, not on a chain of three)
        ok = tl.load(valid_ptr + t * stride_vt + offs_j, mask=in_range, other=0) != 0
        idx = tl.load(idx_ptr + t * stride_it + offs_j, mask=in_range, other=0)
        row = rows_ptr + idx[:, None] * stride_r  # int64 indices: int64 offsets
        kv_v = tl.load(row + offs_v[None, :], mask=ok[:, None] & v_mask[None, :], other=0.0)
        kv_v = kv_v.to(q_ptr.dtype.element_ty)
        if IEEE:
            s = tl.dot(q_v, tl.trans(kv_v), input_precision="ieee")
        else:
            s = tl.dot(q_v, tl.trans(kv_v))
        if DR > 0:
            kv_r = tl.load(row + DV + offs_r[None, :], mask=ok[:, None] & r_mask[None, :], other=0.0)
            kv_r = kv_r.to(q_ptr.dtype.element_ty)
            if IEEE:
                s = tl.dot(q_r, tl.trans(kv_r), s, input_precision="ieee")
            else:
                s = tl.dot(q_r, tl.trans(kv_r), s)
        s = tl.where(ok[None, :], s * scale, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, axis=1))
        seen = m_new > float("-inf")  # else no valid slot so far: alpha 1, p 0, all stays exactly 0
        alpha = tl.where(seen, tl.exp(m - m_new), 1.0)
        p = tl.where(ok[None, :] & seen[:, None], tl.exp(s - tl.where(seen, m_new, 0.0)[:, None]), 0.0)
        l = l * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = tl.dot(p, kv_v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(kv_v.dtype), kv_v, acc * alpha[:, None])
        m = m_new

    has = l > 0.0
    out = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
    out_ptrs = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & v_mask[None, :])
    tl.store(lse_ptr + t * stride_lt + offs_h, lse, mask=h_mask)


def latent_attention(q: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor,
                     scale: float, value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], rows [N, D], indices [T, k] int64, valid [T, k] bool -> (out [T, H, value_dim] in q's
    dtype, lse [T, H] fp32); a query with no valid slot gets out 0 and lse -inf."""
    t, heads = q.shape[0], q.shape[1]
    if indices.shape != valid.shape or indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(f"indices {tuple(indices.shape)} and valid {tuple(valid.shape)} must both be [T={t}, k]")
    if q.dim() != 3 or rows.dim() != 2 or rows.shape[1] != q.shape[2] or not 0 < value_dim <= q.shape[2]:
        raise ValueError(f"latent_attention: q {tuple(q.shape)} [T, H, D], rows {tuple(rows.shape)} [N, D], "
                         f"value_dim {value_dim} do not fit")
    d, k = q.shape[2], indices.shape[1]
    if t == 0 or heads == 0 or rows.shape[0] == 0 or k == 0:
        return (torch.zeros(t, heads, value_dim, dtype=q.dtype, device=q.device),
                torch.full((t, heads), float("-inf"), dtype=torch.float32, device=q.device))
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"latent_attention: q dtype {q.dtype} not supported")
    if q.stride(2) != 1:
        q = q.contiguous()
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    indices = indices.to(torch.int64).contiguous()
    valid = valid.contiguous()
    slots = torch.arange(1, k + 1, device=valid.device, dtype=torch.int32)
    end = torch.where(valid, slots, 0).amax(dim=1).to(torch.int32)  # [T]: one past the last valid slot
    valid = valid.view(torch.uint8)  # bool as bytes: 0 / 1
    out = torch.empty(t, heads, value_dim, dtype=q.dtype, device=q.device)  # every element is written
    lse = torch.empty(t, heads, dtype=torch.float32, device=q.device)
    block_h, block_n, warps, stages = attention_config(heads, d, value_dim, q.dtype)
    dr = d - value_dim
    grid = (t, triton.cdiv(heads, block_h))
    _latent_attention_kernel[grid](q, rows, indices, valid, end, out, lse, t, k, heads, float(scale),
                                   q.stride(0), q.stride(1), rows.stride(0), indices.stride(0), valid.stride(0),
                                   out.stride(0), out.stride(1), lse.stride(0),
                                   DV=value_dim, DR=dr, BLOCK_H=block_h,
                                   BLOCK_DV=max(16, triton.next_power_of_2(value_dim)),
                                   BLOCK_DR=max(16, triton.next_power_of_2(max(dr, 1))), BLOCK_N=block_n,
                                   IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return out, lse
