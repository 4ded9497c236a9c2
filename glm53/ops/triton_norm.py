"""Row-invariant RMSNorm and LayerNorm on CUDA (Triton): one program per row, the whole row in one block.

A row's statistics are one tl.sum over a BLOCK = next_power_of_2(D) vector (masked lanes are 0), a
reduction whose shape and order are fixed by D alone, in fp32. Programs never share a row, so the
row count (the grid size) cannot change a row's bits. The rounding points are the reference's
(glm53/ops/torch_ops.py): rms_norm rounds the normalized row to x's dtype before the weight multiply.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from glm53.ops.triton_launch import OPTIONS

MAX_DIM = 32768  # one block per row; the model's widest norm is the hidden size, 6144


def _block_and_warps(d: int) -> tuple[int, int]:
    if d > MAX_DIM:
        raise ValueError(f"norm over {d} > {MAX_DIM} elements is not supported by the one-block kernel")
    block = triton.next_power_of_2(max(d, 1))
    return block, min(16, max(4, block // 512))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / D
    # the reference's rounding: y = (x32 * rsqrt(mean + eps)) in x's dtype, then weight * y
    y = (x * tl.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, D, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / D
    xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / D  # biased, two-pass (as torch)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = xc * tl.rsqrt(var + eps) * w + b
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    flat = x.reshape(math.prod(x.shape[:-1]), d)
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype), out in promote_types(weight, x)."""
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match the last dim {d}")
    flat = _rows(x)
    out = torch.empty(flat.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if flat.shape[0] and d:
        block, warps = _block_and_warps(d)
        _rms_norm_kernel[(flat.shape[0],)](flat, weight.contiguous(), out, d, flat.stride(0), out.stride(0),
                                           float(eps), BLOCK=block, num_warps=warps, **OPTIONS)
    return out.reshape(x.shape)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim: fp32 mean and biased variance, weight and bias, out in x's dtype."""
    d = x.shape[-1]
    if weight.shape != (d,) or bias.shape != (d,):
        raise ValueError(f"layer_norm: weight {tuple(weight.shape)} / bias {tuple(bias.shape)} must be ({d},)")
    flat = _rows(x)
    out = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    if flat.shape[0] and d:
        block, warps = _block_and_warps(d)
        _layer_norm_kernel[(flat.shape[0],)](flat, weight.contiguous(), bias.contiguous(), out, d, flat.stride(0),
                                             out.stride(0), float(eps), BLOCK=block, num_warps=warps, **OPTIONS)
    return out.reshape(x.shape)
