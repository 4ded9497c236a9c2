"""The DSA indexer's scores on CUDA (Triton), row- and key-invariant by construction.

out[t, n] = sum over h = 0..H-1, in that order, of hw[t, h] * relu(scale * q[t, h] . keys[n]).

Grid: (query tiles of BLOCK_T, key tiles of BLOCK_N). A program loads its key tile [BLOCK_N, D] once
and walks the heads sequentially, one tl.dot over the whole (padded) D per head, accumulating in an
fp32 register tile. Each (t, n) is therefore one dot per head plus a fixed sequential sum over
heads, with a tile configuration chosen from (H, D, dtype) only: neither the query count T, nor the
key count N, nor where t or n sit in their tiles changes the instructions that produce it (T and N
are do_not_specialize). bf16/fp16 products are exact in fp32, so the tensor-core dot with fp32
accumulation gives the fp32 reference's value up to summation order; fp32 inputs use ieee dots.

Several sequences' windows of T rows each in one launch (`index_scores_spans`, a batched step's
indexer): a program's query tile lies in one window (the grid's first axis counts each window's
tiles), and its key tile is read through that window's row of a key table; the tile and the dots are
the ones above, so a row gets the bits of its window alone.

Given the positions of the queries and keys, the causal mask is applied in the kernel (-inf where a
key lies in its query's future), and a tile whose keys all lie in the future of all its queries is
written as -inf without its dots: the other scores are the same bits, and the prefill's diagonal
tiles and two kernels over [T, N] (compare, masked_fill) are saved.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.ops.triton_launch import OPTIONS

from glm53.ops import torch_ops


def index_config(heads: int, d: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_N, num_warps, num_stages) from the fixed dims only."""
    if dtype == torch.float32:
        return 32, 32, 4, 2
    return 64, 128, 4, 3  # H200, T=2048 H=32 D=128 N=16384: 0.53 ms (128x128x8 warps: 0.58, 64x64: 0.63)


@triton.jit(do_not_specialize=["T", "N", "TILES", "stride_kr"])
def _index_scores_kernel(q_ptr, hw_ptr, k_ptr, krow_ptr, qpos_ptr, kpos_ptr, out_ptr, T, N, H, D, scale,
                         stride_qt, stride_qh, stride_hwt, stride_hwh, stride_kn, stride_ot, TILES, stride_kr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
                         CAUSAL: tl.constexpr, KEY_POSITIONS: tl.constexpr, KEY_ROWS: tl.constexpr,
                         SPANS: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    if SPANS:  # program row pid_t: tile pid_t % TILES of span pid_t // TILES (T rows a span, its own key row)
        span = pid_t // TILES
        first = span * T
        offs_t = first + (pid_t % TILES) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = offs_t < first + T
        krow_ptr += span.to(tl.int64) * stride_kr
    else:
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = offs_t < T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask = offs_n < N
    d_mask = offs_d < D
    out = out_ptr + offs_t.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    out_mask = t_mask[:, None] & n_mask[None, :]

    if CAUSAL:
        qpos = tl.load(qpos_ptr + offs_t, mask=t_mask, other=-1)
        if KEY_POSITIONS:
            kpos = tl.load(kpos_ptr + offs_n, mask=n_mask, other=0)
        else:
            kpos = offs_n.to(tl.int64)
        all_future = tl.min(tl.where(n_mask, kpos, 1 << 62)) > tl.max(qpos)
    else:
        all_future = False
    if all_future:  # every key after every query (the prefill's upper triangle): nothing to score
        tl.store(out, tl.full((BLOCK_T, BLOCK_N), float("-inf"), tl.float32), mask=out_mask)
    else:
        if KEY_ROWS:  # a paged cache: key n lives in row key_rows[n] of the store
            rows = tl.load(krow_ptr + offs_n, mask=n_mask, other=0)
        else:
            rows = offs_n.to(tl.int64)
        keys = tl.load(k_ptr + rows[:, None] * stride_kn + offs_d[None, :],
                       mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        keys_t = tl.trans(keys)  # [BLOCK_D, BLOCK_N]
        q_rows = q_ptr + offs_t.to(tl.int64)[:, None] * stride_qt + offs_d[None, :]
        hw_rows = hw_ptr + offs_t.to(tl.int64) * stride_hwt

        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for h in range(0, H):  # heads in order, summed in registers: no reduction tree over heads
            qh = tl.load(q_rows + h * stride_qh, mask=t_mask[:, None] & d_mask[None, :], other=0.0)
            if IEEE:
                s = tl.dot(qh, keys_t, input_precision="ieee")
            else:
                s = tl.dot(qh, keys_t)
            wh = tl.load(hw_rows + h * stride_hwh, mask=t_mask, other=0.0)
            # NaN kept, as torch.relu keeps it (tl.maximum's default returns the other operand): a NaN
            # key or query reaches the selection's NaN check on CUDA as on the CPU
            acc += tl.maximum(s * scale, 0.0, propagate_nan=tl.PropagateNan.ALL) * wh[:, None]
        if CAUSAL:
            acc = tl.where(kpos[None, :] > qpos[:, None], float("-inf"), acc)
        tl.store(out, acc, mask=out_mask)


def index_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, scale: float,
                 q_positions: torch.Tensor | None = None, key_positions: torch.Tensor | None = None,
                 key_rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [T, N]: q [T, H, D], head_weights [T, H], keys [N, D]. Given q_positions [T] (int), -inf
    where a key lies in the query's future: key n at key_positions[n] (ascending or not; default n).
    key_rows [N] (int): key n is row key_rows[n] of keys (any number of rows), read in place."""
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2] or head_weights.shape != q.shape[:2]:
        raise ValueError(f"index_scores: q {tuple(q.shape)} [T, H, D], head_weights {tuple(head_weights.shape)} "
                         f"[T, H], keys {tuple(keys.shape)} [N, D] do not fit")
    t, heads, d = q.shape
    n = keys.shape[0] if key_rows is None else key_rows.shape[0]
    torch_ops.check_positions(t, n, q_positions, key_positions)
    if t == 0 or n == 0:
        return torch.zeros(t, n, dtype=torch.float32, device=q.device)
    q, keys = _operands(q, keys)
    qpos = q.new_empty(0, dtype=torch.int64) if q_positions is None else q_positions.to(torch.int64).contiguous()
    kpos = qpos if key_positions is None else key_positions.to(torch.int64).contiguous()
    krows = qpos if key_rows is None else key_rows.to(torch.int64).contiguous()
    return _launch(q, head_weights, keys, scale, qpos, kpos, krows, n, spans=0,
                   causal=q_positions is not None, key_positions=key_positions is not None,
                   key_rows=key_rows is not None)


def index_scores_spans(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, scale: float,
                       q_positions: torch.Tensor, key_table: torch.Tensor,
                       key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Several sequences' scores in one launch: q [B * T, H, D] (T rows a sequence, in sequence
    order), key_table [B, N] (int): sequence b's key n is row key_table[b, n] of keys; key n lies at
    position key_positions[n] (the same for every sequence: a DCP rank's owned positions; default n),
    -inf past each query's position. fp32 [B * T, N]. A row's scores are index_scores' for its own
    sequence alone (the same tile configuration and dot per head; only which keys a tile reads
    changes); keys past a sequence's own count score -inf when their positions are past its queries
    (the caller's padding)."""
    b = key_table.shape[0]
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2] or head_weights.shape != q.shape[:2] \
            or key_table.dim() != 2 or (b and q.shape[0] % b) or q_positions.shape != q.shape[:1] \
            or (key_positions is not None and key_positions.shape != key_table.shape[1:]):
        raise ValueError(f"index_scores_spans: q {tuple(q.shape)} [B * T, H, D], head_weights "
                         f"{tuple(head_weights.shape)} [B * T, H], keys {tuple(keys.shape)} [S, D], key_table "
                         f"{tuple(key_table.shape)} [B, N], q_positions {tuple(q_positions.shape)} [B * T], "
                         f"key_positions {None if key_positions is None else tuple(key_positions.shape)} [N] do not fit")
    n = key_table.shape[1]
    if q.shape[0] == 0 or n == 0:
        return torch.zeros(q.shape[0], n, dtype=torch.float32, device=q.device)
    q, keys = _operands(q, keys)
    qpos = q_positions.to(torch.int64).contiguous()
    table = key_table.to(torch.int64).contiguous()
    kpos = qpos if key_positions is None else key_positions.to(torch.int64).contiguous()
    return _launch(q, head_weights, keys, scale, qpos, kpos, table, n, spans=b, causal=True,
                   key_positions=key_positions is not None, key_rows=True)


def _operands(q: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and keys as the kernel reads them: both bf16/fp16 (tensor-core dots), else both fp32 (ieee
    dots, exact); the last dim contiguous."""
    if q.dtype != keys.dtype or q.dtype not in (torch.bfloat16, torch.float16):
        q, keys = q.to(torch.float32), keys.to(torch.float32)
    if q.stride(2) != 1:
        q = q.contiguous()
    if keys.stride(1) != 1:
        keys = keys.contiguous()
    return q, keys


def _launch(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, scale: float, qpos: torch.Tensor,
            kpos: torch.Tensor, krows: torch.Tensor, n: int, spans: int, causal: bool, key_positions: bool,
            key_rows: bool) -> torch.Tensor:
    """One launch of the kernel over [T, n] (spans = 0) or spans sequences of T / spans rows each."""
    t, heads, d = q.shape
    hw = head_weights.to(torch.float32)
    out = torch.empty(t, n, dtype=torch.float32, device=q.device)  # every element is written
    block_t, block_n, warps, stages = index_config(heads, d, q.dtype)
    block_d = max(16, triton.next_power_of_2(d))
    rows = t // spans if spans else t
    tiles = triton.cdiv(rows, block_t)
    grid = (spans * tiles if spans else tiles, triton.cdiv(n, block_n))
    _index_scores_kernel[grid](q, hw, keys, krows, qpos, kpos, out, rows, n, heads, d, float(scale),
                               q.stride(0), q.stride(1), hw.stride(0), hw.stride(1), keys.stride(0), out.stride(0),
                               tiles, krows.stride(0) if spans else 0,
                               BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_D=block_d, IEEE=q.dtype == torch.float32,
                               CAUSAL=causal, KEY_POSITIONS=key_positions, KEY_ROWS=key_rows, SPANS=spans > 0,
                               num_warps=warps, num_stages=stages, **OPTIONS)
    return out
