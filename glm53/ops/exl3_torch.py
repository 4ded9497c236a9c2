"""EXL3 products from the packed trellis in plain torch: the CPU path, and the arithmetic the CUDA
kernels (glm53/ops/triton_exl3.py) implement. One linear, for rows x [M, in] in the compute dtype:

    xs  = A(x * suh)                       A: the activation dtype, fp16 (fp32 where the model computes in fp32)
    xr  = A(H(xs) * 2^-3.5)                H: the 128-block Hadamard (+-1 entries), sums in fp32 (here as
                                           one product per row; the CUDA kernels as tensor-core products)
    acc = xr @ W_hat                       W_hat: the codebook values of the trellis (fp16), sums in fp32
    y   = C(H(acc) * 2^-3.5 * svh)         C: the compute dtype

which is x @ W for W = diag(suh) H W_hat H diag(svh) / 128, the weight exllamav3 reconstructs
(glm53/exl3/decode.py), computed without ever forming W. An MLP (a routed expert, the shared expert,
the dense MLP) chains three: act = C(silu(g) * u) from the gate and up outputs g, u (fp32 product,
one rounding), then down; a routed expert's output is weighted, C(y * w), and a token's parts are
summed in ascending expert order from zero, rounding after each add (the shared expert, weight 1,
last). The dense MLP is the same with one expert of weight 1.

Here every product is a one-row product (glm53.ops.torch_ops), so a row's bits never depend on the
other rows; W_hat is decoded from the bank as used, through a bounded cache (Exl3Bank.rotated).
"""
from __future__ import annotations

import math

import torch

from glm53.exl3.bank import Exl3Bank, MlpMatrices
from glm53.exl3.decode import fwht
from glm53.ops import torch_ops

HAD = 128
SCALE = float(torch.tensor(1 / math.sqrt(HAD), dtype=torch.float32))  # 2^-3.5 as fp32
CPU_CACHE_BYTES = 1 << 30  # decoded W_hat the CPU path keeps (fp32), least recently used first out

def activation_dtype(compute: torch.dtype) -> torch.dtype:
    """The dtype of the rotated activations the trellis product takes: fp16 (the codebook's dtype,
    the tensor cores' operand) for a bf16 or fp16 model, fp32 for an fp32 one."""
    return torch.float32 if compute == torch.float32 else torch.float16


_SIGNS: dict[torch.device, torch.Tensor] = {}


def _hadamard_signs(device: torch.device) -> torch.Tensor:
    """The 128x128 Sylvester Hadamard's +-1 entries in fp32 (symmetric: H == H.T)."""
    if device not in _SIGNS:
        _SIGNS[device] = fwht(torch.eye(HAD, dtype=torch.float32)).to(device)
    return _SIGNS[device]


def _blocks_times_h(v32: torch.Tensor) -> torch.Tensor:
    """H applied to each 128-block of each row of fp32 [M, n]: one product per row with the +-1 matrix
    (torch_ops' batched form, in which a row's bits never depend on the other rows). A product, not
    butterflies: a handful of kernel calls where seven stages cost dozens at the tiny sizes CPU tests run."""
    m, n = v32.shape
    if m == 0:
        return v32
    signs = _hadamard_signs(v32.device)
    return torch_ops._matmul32(v32.view(m, n // HAD, HAD), signs.expand(m, HAD, HAD)).view(m, n)


def rotate(x: torch.Tensor, suh: torch.Tensor, act: torch.dtype) -> torch.Tensor:
    """xr = A(H(A(x * suh)) * 2^-3.5): x [M, n] (any float dtype), suh fp16 [n] -> [M, n] in `act`."""
    xs = (x.to(torch.float32) * suh.to(torch.float32)).to(act)
    return (_blocks_times_h(xs.to(torch.float32)) * SCALE).to(act)


def unrotate(acc: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """fp32 H(acc) * 2^-3.5 * svh for acc fp32 [M, n]."""
    return _blocks_times_h(acc) * SCALE * svh.to(torch.float32)


def trellis_product(bank: Exl3Bank, m: int, xr: torch.Tensor) -> torch.Tensor:
    """fp32 xr @ W_hat of matrix m (xr [M, in_read]), one-row products."""
    w_hat = bank.rotated(m, CPU_CACHE_BYTES, torch.float32)
    return torch_ops.linear(xr.to(torch.float32), w_hat.T)


def widen(x: torch.Tensor, width: int, start: int) -> torch.Tensor:
    """x [M, n] placed at columns [start, start + n) of zeros [M, width] (padded or TP-widened inputs)."""
    if x.shape[1] == width and start == 0:
        return x
    out = x.new_zeros(x.shape[0], width)
    out[:, start:start + x.shape[1]] = x
    return out


def linear(x: torch.Tensor, bank: Exl3Bank, m: int, in_start: int = 0, out_start: int = 0,
           out_features: int | None = None) -> torch.Tensor:
    """Matrix m over rows x [M, n] (input columns [in_start, in_start + n) of the matrix, zeros
    elsewhere) -> [M, out_features] in x's dtype: output columns [out_start, out_start + out_features)."""
    lay = bank.layouts[m]
    suh, svh = bank.sign_vectors(m)
    xr = rotate(widen(x, lay.in_read, in_start), suh, activation_dtype(x.dtype))
    y = unrotate(trellis_product(bank, m, xr), svh).to(x.dtype)
    n_out = lay.out_read - out_start if out_features is None else out_features
    return y[:, out_start:out_start + n_out]


def mlp_rows(x: torch.Tensor, bank: Exl3Bank, gate: int, up: int, down: int) -> torch.Tensor:
    """One MLP (gate, up, down matrix indices) over rows x [M, hidden] -> [M, hidden] in x's dtype."""
    g = linear(x, bank, gate).to(torch.float32)
    u = linear(x, bank, up).to(torch.float32)
    act = (torch_ops.silu(g) * u).to(x.dtype)
    return linear(act, bank, down)


def mlp(x: torch.Tensor, bank: Exl3Bank, mats: MlpMatrices, ids: torch.Tensor,
        weights: torch.Tensor | None) -> torch.Tensor:
    """Routed experts (ids [T, K] into 0..n_experts-1, each token's distinct; weights fp32 [T, K], None:
    weight 1) plus the shared expert, or the dense MLP (K = 0, mats.shared its matrices), as
    glm53.ops.triton_exl3.mlp computes them: [T, hidden] in x's dtype."""
    gate, up, down = mats.matrices
    t, k = ids.shape
    cols, wts = [ids], [weights.to(torch.float32) if weights is not None
                        else torch.ones(t, k, dtype=torch.float32, device=x.device)]
    if mats.shared is not None:  # the shared expert: the largest id, so summed last; weight 1
        cols.append(torch.full((t, 1), mats.n_experts, dtype=ids.dtype, device=x.device))
        wts.append(torch.ones(t, 1, dtype=torch.float32, device=x.device))
    all_ids, all_w = torch.cat(cols, dim=1), torch.cat(wts, dim=1)
    parts = torch.zeros(t, all_ids.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
    for e in torch.unique(all_ids).tolist():
        token, slot = (all_ids == e).nonzero(as_tuple=True)
        y = mlp_rows(x[token], bank, gate[e], up[e], down[e])
        parts[token, slot] = (y.to(torch.float32) * all_w[token, slot, None]).to(x.dtype)
    order = all_ids.argsort(dim=1, stable=True)  # a token's experts ascending
    out = torch.zeros_like(x)
    for j in range(all_ids.shape[1]):
        out = out + parts.gather(1, order[:, j, None, None].expand(t, 1, x.shape[1]))[:, 0]
    return out
