"""Absorbed MLA over each query's own selected latent rows on CUDA (Triton), row-invariant by construction.

A query's arithmetic, whichever kernel runs it: its k selection slots in blocks of BLOCK_N in
ascending slot order, gathering rows[indices[t, j]] (masked by valid, so an invalid slot's index is
never dereferenced); per block the scaled scores (two tl.dots: the value part [0, value_dim) and the
rest; GLM-5.3 512 latent + 64 rope, the tiny model 64 + 16, each padded to a power of two with
masks), then one online-softmax step: running max m, sum l and fp32 accumulator. The scores are
kept in log2 units (the scale times log2(e), one multiply) and exponentiated by 2^x as one
ex2.approx.ftz (`_exp2`); the lse goes out in natural units. `_block_scores` and `_softmax_step`
are that arithmetic, shared by the kernels below.

Two ways to run it, chosen by the query count T alone:
  * T > SPLIT_ROWS (prefill): grid (query, block of BLOCK_H heads); one program walks all slots.
  * T <= SPLIT_ROWS (decode, verification, a one-word extension): one program per query leaves the
    GPU idle (~182 us a GLM-5.3 layer at T = 1 on the H200, one SM busy), so the same steps are
    spread out: _latent_scores_kernel computes every slot block's scores at once (grid: query, slot
    block, heads) into an fp32 scratch, then _latent_values_kernel runs the online softmax over them,
    each program for BLOCK_V of the value columns (grid: query, column block, heads): ~60 us. The
    max, the exps and the sums are the prefill program's; the column split only narrows the PV dot.
    One thing differs: the row sum tl.sum(p) reduces in an order set by the register layout, and
    the prefill kernel's scores come out of a tensor-core dot. So the values kernel passes the
    scores it reads back through a dot with zero operands (s + 0, exact; RELAYOUT) with the prefill
    kernel's warps: they land in that layout, and the sum takes that order.
That the two agree bit for bit is a property of the compiled code, not of the source alone, so it
is checked once per shape key on the device (`split_choice`: random inputs, both ways, torch.equal,
for each candidate config) before a short window uses the split; where none agrees (another GPU or compiler), short
windows run the prefill kernel, slower and still exact.

Validity: a mask loaded per slot block, or, where the caller gives it as a prefix (`valid_prefix`: a
Selection's valid slots come first) and the device's check allows it (`prefix_choice`), a compare
with the row's end: the same bits without the loads (H200, GLM-5.3's shape: 1.09x).

Invariance: a program sees one query only, in a fixed order, with configs from (H, D, value_dim,
dtype) and the device alone (T and k are do_not_specialize), so neither T nor the query's position
changes its bits. The device decides once per shape key which candidate config runs: the first whose
compiled kernel fits its shared memory a block (`fit_prefill`; the H200's 227 KB hold the preferred
one, GB10's 99 KB do not). A block with no valid slot is an exact no-op (alpha = 1, p = 0), so
invalid trailing slots (a wider k) change nothing, and the loop stops after the block holding the
query's last valid slot: the same bits, without the work (a short context, a DCP rank that owns a
quarter of the selection). No valid slot at all gives out 0 and lse -inf, never NaN.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from glm53.ops.triton_launch import OPTIONS

LOG2E, LN2 = 1.4426950408889634, tl.constexpr(0.6931471805599453)  # the softmax runs in log2 units
SPLIT_ROWS = 16  # up to this many queries a call takes the split kernels (where they agree bitwise)
_ZEROS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # the re-layout's zero operand, per device and dtype


def attention_candidates(heads: int, d: int, value_dim: int, dtype: torch.dtype) -> list[tuple[int, int, int, int]]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages) configs from the fixed dims only, preferred first: a
    device runs the first whose compiled prefill kernel fits its shared memory a block
    (`attention_config`). Each is exact and row-invariant; they differ in bits (BLOCK_N sets the
    online softmax's steps), so a device keeps one for good (the prefix cache's key names the device
    and the compiler)."""
    block_h = max(16, min(64, triton.next_power_of_2(heads)))  # tl.dot needs >= 16 rows
    if dtype == torch.float32:
        return [(min(block_h, 16), 16, 4, 1)]
    # all 64 heads of a query share its gathered rows: one program per query reads each row once
    # H200, T=2048 H=64 k=2048 D=576: 2.9 ms, 255 registers, no spills (3 stages spill: 3.7 ms;
    # BLOCK_N 32: 4.1 ms; BLOCK_H 32: 7.7 ms); BLOCK_N 128 runs out of shared memory.
    # The rest are for GPUs with less shared memory a block: GB10 (DGX Spark, sm_121) has 99 KB,
    # where the first needs 176 KB (Triton 3.9, AOT for sm_121 with the launch's specialization:
    # tests/test_triton_compile.py). H200 side by side (docs/decisions/triton-configs.md,
    # Triton 3.6; GB10's own times need a GB10), prefill time against the first's, whether the split
    # decode kernels agree (else decode runs the prefill kernel: 260 us a layer against 59-107),
    # shared memory there / for sm_121:
    # 64 heads x 16 slots, 8 warps: 1.85x, agree (108 / 98 KB: GB10's on Triton 3.9, 1 KB to spare);
    # the same unpipelined (1 stage): the same bits, 2.18x (90 / 96 KB), for a compiler that needs
    # more; 32 x 32, 4 warps 1.81x, differ (88 / 88 KB); 16 x 16 3.41x (44 KB). 16 x 64 is left out:
    # 106 KB for sm_121 pipelined, 98 not (2.37x), it fits nowhere the unpipelined 64 x 16 does not.
    # Fitting is decided with validity loaded; the prefix compare runs only where its kernel fits
    # too (prefix_choice). Triton 3.9 for sm_121: 64 x 16 pipelined 92 KB that way, its unpipelined
    # twin 104 KB, so a GB10 that falls back to the twin runs it with validity loaded.
    found = [(block_h, 64, 8, 2), (block_h, 16, 8, 2), (block_h, 16, 8, 1), (min(block_h, 32), 32, 4, 2),
             (16, 16, 4, 2)]
    return list(dict.fromkeys(found))  # in order, once each (few heads repeat one)


_FITTED: dict[tuple, tuple[int, int, int, int]] = {}


def attention_config(heads: int, d: int, value_dim: int, dtype: torch.dtype,
                     fitted: tuple | None = None) -> tuple[int, int, int, int]:
    """The config the prefill kernel (and the split scores kernel) run with: the one found for this
    shape key on this device (`fit_prefill`, key `fitted`), else the preferred candidate."""
    if fitted is not None and fitted in _FITTED:
        return _FITTED[fitted]
    return attention_candidates(heads, d, value_dim, dtype)[0]


def first_fitting(candidates: list, shared_bytes, limit: int):
    """The first candidate whose kernel needs at most `limit` bytes of shared memory a block
    (shared_bytes(candidate): the compiled kernel's), or None."""
    return next((c for c in candidates if shared_bytes(c) <= limit), None)


def split_candidates(heads: int, d: int, value_dim: int, dtype: torch.dtype,
                     fitted: tuple | None = None) -> list[tuple[int, int, int, int]]:
    """(BLOCK_V, num_warps, num_stages, RELAYOUT) configs of the values kernel, fastest first (its scores
    kernel runs attention_config). num_warps is the prefill kernel's: the re-layout must land on its
    layout (the tiny model's 4 heads with 4 warps differ in bits). RELAYOUT 1 dots constant zeros
    (fastest; a compiler could fold them away, then the check fails), 2 loaded zeros.
    H200 (docs/decisions/triton-configs.md, bench/results/split_attention_h200.json), T = 1 over 2048
    slots: GLM-5.3 bf16 60 us against the prefill kernel's 182, fp32 133 against 1725, the tiny
    model 45 against 55."""
    warps = attention_config(heads, d, value_dim, dtype, fitted)[2]
    stages = 1 if dtype == torch.float32 else 2
    return [(32, warps, stages, 1), (32, warps, stages, 2)]


# ---- the arithmetic every kernel shares ----------------------------------------------------------
@triton.jit
def _load_queries(q_ptr, t, stride_qt, stride_qh, offs_h, h_mask, offs_v, v_mask, offs_r, r_mask,
                  DV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DR: tl.constexpr):
    q_base = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    q_v = tl.load(q_base + offs_v[None, :], mask=h_mask[:, None] & v_mask[None, :], other=0.0)
    if DR > 0:
        q_r = tl.load(q_base + DV + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    else:
        q_r = tl.zeros((BLOCK_H, BLOCK_DR), dtype=q_v.dtype)
    return q_v, q_r


@triton.jit
def _block_slots(idx_ptr, valid_ptr, end, t, jb, K_SLOTS, stride_it, stride_vt, BLOCK_N: tl.constexpr,
                 PREFIX: tl.constexpr):
    """Slot block jb of query t: the slots' row indices and validity (idx and valid load side by side,
    so the gather waits on both, not on a chain of three). PREFIX: the valid slots are [0, end), so
    validity is a compare, not a load (H200: the prefill kernel 1.09x, the same bits)."""
    offs_j = jb * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = offs_j < K_SLOTS
    if PREFIX:
        ok = offs_j < end
    else:
        ok = tl.load(valid_ptr + t * stride_vt + offs_j, mask=in_range, other=0) != 0
    idx = tl.load(idx_ptr + t * stride_it + offs_j, mask=in_range, other=0)
    return idx, ok


@triton.jit
def _block_scores(q_v, q_r, rows_ptr, idx_ptr, valid_ptr, end, t, jb, K_SLOTS, scale, stride_r, stride_it,
                  stride_vt, offs_v, v_mask, offs_r, r_mask, DV: tl.constexpr, DR: tl.constexpr,
                  BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PREFIX: tl.constexpr):
    """Slot block jb of query t: scaled scores [BLOCK_H, BLOCK_N] (scale: the softmax scale times
    log2(e), `_kernel_scale`; -inf at invalid slots), the slots' validity, and their gathered value
    columns [BLOCK_N, BLOCK_DV] in q's dtype."""
    idx, ok = _block_slots(idx_ptr, valid_ptr, end, t, jb, K_SLOTS, stride_it, stride_vt, BLOCK_N, PREFIX)
    row = rows_ptr + idx[:, None] * stride_r  # int64 indices: int64 offsets
    kv_v = tl.load(row + offs_v[None, :], mask=ok[:, None] & v_mask[None, :], other=0.0).to(q_v.dtype)
    if IEEE:
        s = tl.dot(q_v, tl.trans(kv_v), input_precision="ieee")
    else:
        s = tl.dot(q_v, tl.trans(kv_v))
    if DR > 0:
        kv_r = tl.load(row + DV + offs_r[None, :], mask=ok[:, None] & r_mask[None, :], other=0.0).to(q_v.dtype)
        if IEEE:
            s = tl.dot(q_r, tl.trans(kv_r), s, input_precision="ieee")
        else:
            s = tl.dot(q_r, tl.trans(kv_r), s)
    s = tl.where(ok[None, :], s * scale, float("-inf"))
    return s, ok, kv_v


@triton.jit
def _exp2_ftz(x):
    """2^x as one MUFU.EX2 (results below 2^-126 flush to 0; 2^-inf is 0), without tl.exp's multiply by
    log2(e) and its range fix-up for subnormal results: the prefill kernel 1.16x (H200, GLM-5.3's
    shape, 2.310 against 2.680 ms; bench/results/attention_bound_h200_in_use.json against
    attention_bound_h200_transposed.json's in-use row). The accuracy of
    FlashAttention's fast-math exp2."""
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _exp2_interpreted(x):
    """Triton's interpreter (the CPU tests) runs no PTX: numpy's 2^x, other bits, the same rules."""
    return tl.exp2(x)


_exp2 = _exp2_interpreted if isinstance(_exp2_ftz, InterpretedFunction) else _exp2_ftz


@triton.jit
def _softmax_step(m, l, acc, s, ok, kv, IEEE: tl.constexpr):
    """One block of the online softmax in log2 units: (m, l, acc) after scores s [BLOCK_H, BLOCK_N]
    (already times log2(e); -inf at invalid slots) over values kv [BLOCK_N, columns]."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    seen = m_new > float("-inf")  # else no valid slot so far: alpha 1, p 0, all stays exactly 0
    alpha = tl.where(seen, _exp2(m - m_new), 1.0)
    # 2^-inf is exactly 0, so the mask on p is redundant; without it the prefill kernel is 1.05x
    # faster (H200), but the split kernels' row sums then differ in bits at 16 heads and fewer
    p = tl.where(ok[None, :] & seen[:, None], _exp2(s - tl.where(seen, m_new, 0.0)[:, None]), 0.0)
    l = l * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = tl.dot(p, kv, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None])
    return m_new, l, acc


@triton.jit
def _store_result(out_ptr, lse_ptr, t, stride_ot, stride_oh, stride_lt, acc, l, m, offs_h, h_mask, offs_c, c_mask,
                  WRITE_LSE: tl.constexpr):
    has = l > 0.0
    out = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    out_ptrs = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_c[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & c_mask[None, :])
    if WRITE_LSE:
        lse = tl.where(has, m * LN2 + tl.log(tl.where(has, l, 1.0)), float("-inf"))  # m in log2 units
        tl.store(lse_ptr + t * stride_lt + offs_h, lse, mask=h_mask)


# ---- prefill: one program per (query, head block) --------------------------------------------------
@triton.jit(do_not_specialize=["T", "K_SLOTS"])
def _latent_attention_kernel(q_ptr, rows_ptr, idx_ptr, valid_ptr, end_ptr, out_ptr, lse_ptr, T, K_SLOTS, H, scale,
                             stride_qt, stride_qh, stride_r, stride_it, stride_vt, stride_ot, stride_oh, stride_lt,
                             DV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
                             BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                             PREFIX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    h_mask, v_mask, r_mask = offs_h < H, offs_v < DV, offs_r < DR
    q_v, q_r = _load_queries(q_ptr, t, stride_qt, stride_qh, offs_h, h_mask, offs_v, v_mask, offs_r, r_mask,
                             DV, DR, BLOCK_H, BLOCK_DR)
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), dtype=tl.float32)
    end = tl.load(end_ptr + t)  # one past the query's last valid slot: later blocks are no-ops
    for jb in range(0, tl.cdiv(end, BLOCK_N)):  # slots in ascending order, fixed blocks
        s, ok, kv_v = _block_scores(q_v, q_r, rows_ptr, idx_ptr, valid_ptr, end, t, jb, K_SLOTS, scale, stride_r,
                                    stride_it, stride_vt, offs_v, v_mask, offs_r, r_mask, DV, DR, BLOCK_N, IEEE,
                                    PREFIX)
        m, l, acc = _softmax_step(m, l, acc, s, ok, kv_v, IEEE)
    _store_result(out_ptr, lse_ptr, t, stride_ot, stride_oh, stride_lt, acc, l, m, offs_h, h_mask, offs_v, v_mask,
                  True)


# ---- short windows: scores of all slot blocks at once, then the softmax per column block --------
@triton.jit(do_not_specialize=["T", "K_SLOTS"])
def _latent_scores_kernel(q_ptr, rows_ptr, idx_ptr, valid_ptr, end_ptr, s_ptr, T, K_SLOTS, H, scale,
                          stride_qt, stride_qh, stride_r, stride_it, stride_vt, stride_st, stride_sh,
                          DV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
                          BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                          PREFIX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    jb = tl.program_id(1)
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    end = tl.load(end_ptr + t)
    if jb * BLOCK_N < end:  # blocks past the last valid slot: never read
        offs_v = tl.arange(0, BLOCK_DV)
        offs_r = tl.arange(0, BLOCK_DR)
        h_mask, v_mask, r_mask = offs_h < H, offs_v < DV, offs_r < DR
        q_v, q_r = _load_queries(q_ptr, t, stride_qt, stride_qh, offs_h, h_mask, offs_v, v_mask, offs_r, r_mask,
                                 DV, DR, BLOCK_H, BLOCK_DR)
        s, ok, kv_v = _block_scores(q_v, q_r, rows_ptr, idx_ptr, valid_ptr, end, t, jb, K_SLOTS, scale, stride_r,
                                    stride_it, stride_vt, offs_v, v_mask, offs_r, r_mask, DV, DR, BLOCK_N, IEEE,
                                    PREFIX)
        offs_j = jb * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(s_ptr + t * stride_st + offs_h[:, None] * stride_sh + offs_j[None, :], s, mask=h_mask[:, None])


@triton.jit(do_not_specialize=["T", "K_SLOTS"])
def _latent_values_kernel(s_ptr, rows_ptr, idx_ptr, valid_ptr, end_ptr, zeros_ptr, out_ptr, lse_ptr, T, K_SLOTS, H,
                          stride_st, stride_sh, stride_r, stride_it, stride_vt, stride_ot, stride_oh, stride_lt,
                          DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr,
                          RELAYOUT: tl.constexpr, IEEE: tl.constexpr, PREFIX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = cb * BLOCK_V + tl.arange(0, BLOCK_V)
    h_mask, c_mask = offs_h < H, offs_c < DV
    if RELAYOUT > 0:  # zero operands of the scores' re-layout (below); 2: loaded, so nothing folds them away
        offs_z = tl.arange(0, 16)
        if RELAYOUT == 2:
            zero_a = tl.load(zeros_ptr + offs_h[:, None] * 0 + offs_z[None, :])
            zero_b = tl.load(zeros_ptr + offs_z[:, None] + tl.arange(0, BLOCK_N)[None, :] * 0)
        else:
            zero_a = tl.zeros((BLOCK_H, 16), dtype=out_ptr.dtype.element_ty)
            zero_b = tl.zeros((16, BLOCK_N), dtype=out_ptr.dtype.element_ty)
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_V), dtype=tl.float32)
    s_rows = s_ptr + t * stride_st + offs_h[:, None] * stride_sh
    end = tl.load(end_ptr + t)
    for jb in range(0, tl.cdiv(end, BLOCK_N)):
        offs_j = jb * BLOCK_N + tl.arange(0, BLOCK_N)
        idx, ok = _block_slots(idx_ptr, valid_ptr, end, t, jb, K_SLOTS, stride_it, stride_vt, BLOCK_N, PREFIX)
        s = tl.load(s_rows + offs_j[None, :], mask=h_mask[:, None], other=float("-inf"))
        if RELAYOUT > 0:
            # s + 0 (exact) out of a tensor-core dot: the scores then sit in the register layout of the
            # prefill kernel's (a dot's output), so tl.sum(p) reduces them in the same order there
            if IEEE:
                s = tl.dot(zero_a, zero_b, s, input_precision="ieee")
            else:
                s = tl.dot(zero_a, zero_b, s)
        kv = tl.load(rows_ptr + idx[:, None] * stride_r + offs_c[None, :], mask=ok[:, None] & c_mask[None, :],
                     other=0.0).to(out_ptr.dtype.element_ty)
        m, l, acc = _softmax_step(m, l, acc, s, ok, kv, IEEE)
    _store_result(out_ptr, lse_ptr, t, stride_ot, stride_oh, stride_lt, acc, l, m, offs_h, h_mask, offs_c, c_mask,
                  cb == 0)


# ---- entry points ---------------------------------------------------------------------------------
def _prepared(q: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor):
    if q.stride(2) != 1:
        q = q.contiguous()
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    indices = indices.to(torch.int64).contiguous()
    valid = valid.contiguous()
    slots = torch.arange(1, indices.shape[1] + 1, device=valid.device, dtype=torch.int32)
    end = torch.where(valid, slots, 0).amax(dim=1).to(torch.int32)  # [T]: one past the last valid slot
    return q, rows, indices, valid.view(torch.uint8), end  # valid as bytes: 0 / 1


def _query_blocks(d: int, value_dim: int) -> dict[str, int]:
    """The constexprs of a query row's two parts: the value part [0, value_dim) and the rest."""
    dr = d - value_dim
    return {"DV": value_dim, "DR": dr, "BLOCK_DV": max(16, triton.next_power_of_2(value_dim)),
            "BLOCK_DR": max(16, triton.next_power_of_2(max(dr, 1)))}


def _kernel_scale(scale: float) -> float:
    """The scale the kernels multiply scores by: the softmax's, in log2 units (one rounding, to fp32 at
    the launch, the same for every kernel so that their bits agree)."""
    return float(scale) * LOG2E


def _shape_key(heads: int, d: int, value_dim: int, dtype: torch.dtype, rows_dtype: torch.dtype,
               device: torch.device) -> tuple:
    """What the configs are chosen by: the fixed dims and the device (its index made explicit)."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    return (heads, d, value_dim, dtype, rows_dtype, device)


def _prefill_launch(args: tuple, scale: float, value_dim: int, config: tuple[int, int, int, int], warmup: bool,
                    prefix: bool = False):
    """The prefill kernel over `args` (q, rows, indices, valid, end, out, lse) with `config`; warmup:
    compile only (Triton's JITFunction.warmup), returning the compiled kernel. prefix: the valid
    slots of each query are [0, end) (latent_attention's valid_prefix)."""
    q, rows, indices, valid, end, out, lse = args
    t, heads, d = q.shape
    block_h, block_n, warps, stages = config
    grid = (t, triton.cdiv(heads, block_h))
    kernel = _latent_attention_kernel.warmup if warmup else _latent_attention_kernel[grid]
    extra = {"grid": grid} if warmup else {}
    return kernel(q, rows, indices, valid, end, out, lse, t, indices.shape[1], heads, _kernel_scale(scale),
                  q.stride(0), q.stride(1), rows.stride(0), indices.stride(0), valid.stride(0),
                  out.stride(0), out.stride(1), lse.stride(0), **_query_blocks(d, value_dim),
                  BLOCK_H=block_h, BLOCK_N=block_n, IEEE=q.dtype == torch.float32, PREFIX=prefix,
                  num_warps=warps, num_stages=stages, **OPTIONS, **extra)


def fit_prefill(args: tuple, scale: float, value_dim: int) -> tuple | None:
    """On CUDA: the shape key whose config `attention_config` returns, found once per key on this
    device: the first candidate whose compiled prefill kernel fits the device's shared memory a
    block (compiled with these arguments, validity loaded, not launched). The prefix form of that
    config runs only where it fits too (`prefix_choice`). None elsewhere (the interpreter)."""
    q, rows = args[0], args[1]
    if q.device.type != "cuda":
        return None
    key = _shape_key(q.shape[1], q.shape[2], value_dim, q.dtype, rows.dtype, q.device)
    if key not in _FITTED:
        heads, d = q.shape[1], q.shape[2]
        limit = triton.runtime.driver.active.utils.get_device_properties(q.device.index)["max_shared_mem"]
        candidates = attention_candidates(heads, d, value_dim, q.dtype)
        found = first_fitting(candidates, lambda c: _prefill_launch(args, scale, value_dim, c, True).metadata.shared,
                              limit)
        if found is None:
            raise RuntimeError(f"latent_attention: none of the prefill kernel's configs {candidates} fits "
                               f"{torch.cuda.get_device_name(q.device)}'s {limit} bytes of shared memory a block "
                               f"({heads} heads x {d}, {q.dtype}); a smaller candidate is needed in "
                               "glm53/ops/triton_attention.py attention_candidates")
        if found != candidates[0]:
            print(f"glm53: latent_attention runs {found} (BLOCK_H, BLOCK_N, warps, stages) on "
                  f"{torch.cuda.get_device_name(q.device)}: its {limit} bytes of shared memory a block do not hold "
                  f"{candidates[0]}", file=sys.stderr)
        _FITTED[key] = found
    return key


def _run_prefill(q, rows, indices, valid, end, out, lse, scale: float, value_dim: int, prefix: bool = False) -> None:
    args = (q, rows, indices, valid, end, out, lse)
    fitted = fit_prefill(args, scale, value_dim)
    _prefill_launch(args, scale, value_dim, attention_config(q.shape[1], q.shape[2], value_dim, q.dtype, fitted),
                    False, prefix)


def _zeros(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (device, dtype)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(16, dtype=dtype, device=device)
    return _ZEROS[key]


def _run_split(q, rows, indices, valid, end, out, lse, scale: float, value_dim: int,
               config: tuple[int, int, int, int] | None = None, prefix: bool = False) -> None:
    t, heads, d = q.shape
    k = indices.shape[1]
    # the scores kernel runs the prefill kernel's config
    fitted = fit_prefill((q, rows, indices, valid, end, out, lse), scale, value_dim)
    block_h, block_n, warps, stages = attention_config(heads, d, value_dim, q.dtype, fitted)
    block_v, warps_v, stages_v, relayout = config or split_candidates(heads, d, value_dim, q.dtype, fitted)[0]
    ieee = q.dtype == torch.float32
    scores = torch.empty(t, heads, triton.cdiv(k, block_n) * block_n, dtype=torch.float32, device=q.device)
    head_blocks = triton.cdiv(heads, block_h)
    _latent_scores_kernel[(t, triton.cdiv(k, block_n), head_blocks)](
        q, rows, indices, valid, end, scores, t, k, heads, _kernel_scale(scale),
        q.stride(0), q.stride(1), rows.stride(0), indices.stride(0), valid.stride(0), scores.stride(0),
        scores.stride(1), **_query_blocks(d, value_dim), BLOCK_H=block_h, BLOCK_N=block_n, IEEE=ieee,
        PREFIX=prefix, num_warps=warps, num_stages=stages, **OPTIONS)
    _latent_values_kernel[(t, triton.cdiv(value_dim, block_v), head_blocks)](
        scores, rows, indices, valid, end, _zeros(q.device, q.dtype), out, lse, t, k, heads,
        scores.stride(0), scores.stride(1), rows.stride(0), indices.stride(0), valid.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), DV=value_dim, BLOCK_H=block_h, BLOCK_V=block_v,
        BLOCK_N=block_n, RELAYOUT=relayout, IEEE=ieee, PREFIX=prefix, num_warps=warps_v, num_stages=stages_v,
        **OPTIONS)


def _check(q, rows, indices, valid, value_dim: int) -> None:
    t = q.shape[0]
    if indices.shape != valid.shape or indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(f"indices {tuple(indices.shape)} and valid {tuple(valid.shape)} must both be [T={t}, k]")
    if q.dim() != 3 or rows.dim() != 2 or rows.shape[1] != q.shape[2] or not 0 < value_dim <= q.shape[2]:
        raise ValueError(f"latent_attention: q {tuple(q.shape)} [T, H, D], rows {tuple(rows.shape)} [N, D], "
                         f"value_dim {value_dim} do not fit")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"latent_attention: q dtype {q.dtype} not supported")


def latent_attention(q: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor,
                     scale: float, value_dim: int, *, split: bool | None = None,
                     valid_prefix: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], rows [N, D], indices [T, k] int64, valid [T, k] bool -> (out [T, H, value_dim] in q's
    dtype, lse [T, H] fp32); a query with no valid slot gets out 0 and lse -inf. `split` forces a way
    (tests, benches); None: the split kernels for T <= SPLIT_ROWS with the config `split_choice` found.
    valid_prefix: the caller guarantees that each row's valid slots come first (glm53.model.indexer.
    Selection's form); the kernels then derive validity from its count instead of loading it, where
    `prefix_choice` found that this gives the same bits (a mask of another form gives wrong results)."""
    _check(q, rows, indices, valid, value_dim)
    t, heads, d = q.shape
    k = indices.shape[1]
    if t == 0 or heads == 0 or rows.shape[0] == 0 or k == 0:
        return (torch.zeros(t, heads, value_dim, dtype=q.dtype, device=q.device),
                torch.full((t, heads), float("-inf"), dtype=torch.float32, device=q.device))
    config = None
    if split is None and t <= SPLIT_ROWS:
        config = split_choice(heads, d, value_dim, q.dtype, rows.dtype, q.device)
    elif split:
        config = split_choice(heads, d, value_dim, q.dtype, rows.dtype, q.device) \
            or split_candidates(heads, d, value_dim, q.dtype,
                                _fit_for(heads, d, value_dim, q.dtype, rows.dtype, q.device)
                                if q.device.type == "cuda" else None)[0]
    if valid_prefix:
        valid_prefix = prefix_choice(heads, d, value_dim, q.dtype, rows.dtype, q.device)
    q, rows, indices, valid, end = _prepared(q, rows, indices, valid)
    out = torch.empty(t, heads, value_dim, dtype=q.dtype, device=q.device)  # every element is written
    lse = torch.empty(t, heads, dtype=torch.float32, device=q.device)
    if config is None:
        _run_prefill(q, rows, indices, valid, end, out, lse, scale, value_dim, valid_prefix)
    else:
        _run_split(q, rows, indices, valid, end, out, lse, scale, value_dim, config, valid_prefix)
    return out, lse


# ---- the check that the split gives the prefill kernel's bits ------------------------------------
_CHOSEN: dict[tuple, tuple[int, int, int, int] | None] = {}
CHECK_QUERIES, CHECK_ROWS, CHECK_SLOTS = 16, 4096, 2053


def split_choice(heads: int, d: int, value_dim: int, dtype: torch.dtype, rows_dtype: torch.dtype,
                 device: torch.device) -> tuple[int, int, int, int] | None:
    """The first of `split_candidates` whose split kernels give the prefill kernel's bits for this
    shape key on this device (`agreement`), found once; None if none does. Inside a graph capture
    an unchecked key answers None (no check can run there): the prefill kernel is exact, only slower."""
    if device.type != "cuda":  # Triton's interpreter (tests): the prefill kernel unless a call forces the split
        return None
    key = _checked_key(_CHOSEN, heads, d, value_dim, dtype, rows_dtype, device)
    if key in _CHOSEN:
        return _CHOSEN[key]
    if torch.cuda.is_current_stream_capturing():
        return None
    fitted = _fit_for(heads, d, value_dim, dtype, rows_dtype, device)  # the split runs the prefill's warps
    found = next((c for c in split_candidates(heads, d, value_dim, dtype, fitted)
                  if _agrees(heads, d, value_dim, dtype, rows_dtype, device, c)), None)
    _CHOSEN[key] = found
    if found is None:
        print(f"glm53: latent_attention's split kernels differ from the prefill kernel in their bits for "
              f"{heads} heads x {d} ({dtype}, rows {rows_dtype}) on this device; short windows run the "
              "prefill kernel (exact, slower)", file=sys.stderr)
    return found


_PREFIX_OK: dict[tuple, bool] = {}


def prefix_choice(heads: int, d: int, value_dim: int, dtype: torch.dtype, rows_dtype: torch.dtype,
                  device: torch.device) -> bool:
    """Whether calls that give validity as a prefix may compare instead of loading it: checked once
    per shape key on the device (`prefix_agreement`; a prefix form that does not fit the device's
    shared memory fails too), so the form never changes a result. On the H200 it fails at 16 heads
    and fewer (docs/decisions/triton-configs.md): there BLOCK_H 16 makes the dots mma.sync ones, and Triton
    gives their operands another kWidth in the two forms (4 loaded, 2 compared; Triton 3.9's TTGIR),
    which groups the K products otherwise, so the prefill kernel's own bits differ, full rows too.
    At 64 heads the dots are wgmma ones from shared memory, and both forms agree. The interpreter:
    yes (the CPU tests compare both forms). Inside a graph capture an unchecked key answers no."""
    if device.type != "cuda":
        return True
    key = _checked_key(_PREFIX_OK, heads, d, value_dim, dtype, rows_dtype, device)
    if key in _PREFIX_OK:
        return _PREFIX_OK[key]
    if torch.cuda.is_current_stream_capturing():
        return False
    from triton.runtime.errors import OutOfResources

    split_cfg = split_choice(heads, d, value_dim, dtype, rows_dtype, device)
    try:
        _PREFIX_OK[key] = prefix_agreement(heads, d, value_dim, dtype, rows_dtype, device, split_cfg)
    except OutOfResources:
        _PREFIX_OK[key] = False
    return _PREFIX_OK[key]


def _checked_key(store: dict, heads: int, d: int, value_dim: int, dtype: torch.dtype, rows_dtype: torch.dtype,
                 device: torch.device) -> tuple:
    """The key a once-per-shape check is stored under: the call's own (per call on short windows: no
    string building), or, for a device without an index not yet stored, the explicit one ('cuda' and
    'cuda:0' share one check)."""
    key = (heads, d, value_dim, dtype, rows_dtype, device)
    if key not in store and device.index is None:
        key = _shape_key(heads, d, value_dim, dtype, rows_dtype, device)
    return key


def _fit_for(heads: int, d: int, value_dim: int, dtype: torch.dtype, rows_dtype: torch.dtype,
             device: torch.device) -> tuple | None:
    """fit_prefill for a shape key before any call of it: compiled over a one-query case shaped
    like the engine's (GLM-5.3's 2048-slot selection), nothing launched."""
    key = _shape_key(heads, d, value_dim, dtype, rows_dtype, device)
    if key in _FITTED:  # found already: no tensors to build
        return key
    q = torch.zeros(1, heads, d, dtype=dtype, device=device)
    rows = torch.zeros(16, d, dtype=rows_dtype, device=device)
    indices = torch.zeros(1, 2048, dtype=torch.int64, device=device)
    args = (*_prepared(q, rows, indices, torch.ones(1, 2048, dtype=torch.bool, device=device)),
            torch.empty(1, heads, value_dim, dtype=dtype, device=device),
            torch.empty(1, heads, dtype=torch.float32, device=device))
    return fit_prefill(args, d ** -0.5, value_dim)


def _agrees(*args) -> bool:
    """agreement, where a split config whose scores kernel does not fit the device's shared memory
    does not agree."""
    from triton.runtime.errors import OutOfResources

    try:
        return agreement(*args)
    except OutOfResources:
        return False


def agreement(heads: int, d: int, value_dim: int, dtype: torch.dtype, rows_dtype: torch.dtype,
              device: torch.device, split_cfg: tuple[int, int, int, int] | None = None, *,
              queries: int = CHECK_QUERIES, slots: int = CHECK_SLOTS, n_rows: int = CHECK_ROWS) -> bool:
    """Both ways on random cases, compared with torch.equal (out and lse): CHECK_QUERIES queries over
    CHECK_SLOTS slots (a full selection and a few more; the last block partial) of CHECK_ROWS rows,
    half of the queries with every slot valid, half with a random 80%, one with its last blocks
    invalid. (A small case, 3 queries over 197 slots, passed configs whose bits differ here.)"""
    q, rows, indices, valid = _check_case(heads, d, dtype, rows_dtype, device, queries, slots, n_rows)
    return _same_results(_prepared(q, rows, indices, valid), heads, d, value_dim, dtype,
                         [_run_prefill, lambda *a: _run_split(*a, config=split_cfg)])


def prefix_agreement(heads: int, d: int, value_dim: int, dtype: torch.dtype, rows_dtype: torch.dtype,
                     device: torch.device, split_cfg: tuple[int, int, int, int] | None) -> bool:
    """agreement's case with validity in a Selection's form (each row's valid slots first, random
    counts): the prefill kernel comparing with the row's end gives the bits of the one loading the
    mask, and so do the split kernels (with `split_cfg`, where one agrees) in that form."""
    runs = [_run_prefill, lambda *a: _run_prefill(*a, prefix=True)]
    if split_cfg is not None:
        runs.append(lambda *a: _run_split(*a, config=split_cfg, prefix=True))
    return _same_results(prefix_case(heads, d, dtype, rows_dtype, device)[0], heads, d, value_dim, dtype, runs)


def prefix_case(heads: int, d: int, dtype: torch.dtype, rows_dtype: torch.dtype, device: torch.device
                ) -> tuple[tuple, torch.Tensor]:
    """prefix_agreement's case, prepared (each row's valid slots first: half of the rows full, the
    rest a random count), and each row's valid count."""
    q, rows, indices, _ = _check_case(heads, d, dtype, rows_dtype, device, CHECK_QUERIES, CHECK_SLOTS, CHECK_ROWS)
    g = torch.Generator(device=device).manual_seed(20261203)
    counts = torch.randint(0, CHECK_SLOTS + 1, (CHECK_QUERIES, 1), generator=g, device=device)
    counts[: CHECK_QUERIES // 2] = CHECK_SLOTS
    first = torch.arange(CHECK_SLOTS, device=device)[None, :] < counts
    return _prepared(q, rows, torch.where(first, indices, 0), first), counts[:, 0]


def _check_case(heads: int, d: int, dtype: torch.dtype, rows_dtype: torch.dtype, device: torch.device,
                n: int, k: int, n_rows: int):
    g = torch.Generator(device=device).manual_seed(20261201)
    q = (torch.randn(n, heads, d, generator=g, device=device) * d ** -0.5).to(dtype)
    rows = torch.randn(n_rows, d, generator=g, device=device).to(rows_dtype)
    indices = torch.randint(0, n_rows, (n, k), generator=g, device=device)
    valid = torch.rand(n, k, generator=g, device=device) < 0.8
    valid[: n // 2] = True
    valid[1, k // 3:] = False
    return q, rows, indices, valid


def _same_results(args: tuple, heads: int, d: int, value_dim: int, dtype: torch.dtype, runs: list) -> bool:
    """Whether every run over the prepared `args` gives the first's out and lse, bit for bit."""
    results = [run_outputs(run, args, heads, d, value_dim, dtype) for run in runs]
    return all(torch.equal(o, results[0][0]) and torch.equal(e, results[0][1]) for o, e in results[1:])


def run_outputs(run: Callable[..., None], args: tuple, heads: int, d: int, value_dim: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one way (`_run_prefill`, `_run_split` with its options) over the prepared `args`."""
    n = args[0].shape[0]
    out = torch.empty(n, heads, value_dim, dtype=dtype, device=args[0].device)
    lse = torch.empty(n, heads, dtype=torch.float32, device=args[0].device)
    run(*args, out, lse, d ** -0.5, value_dim)
    return out, lse
