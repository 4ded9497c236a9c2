"""Reference EXL3 decoder in torch (CPU and CUDA): trellis -> fp16 weight.

Orientation: `decode_weight` returns W of shape [in_features, out_features] so that y = x @ W
(exllamav3's orientation; the transpose of an nn.Linear weight).

What the format defines (read from exllamav3 1.6.5's reconstruct kernel and LinearEXL3):
- Each 16x16 tile is a cyclic ("tail-biting") bit stream of 256*K bits, stored as 32-bit words
  read most-significant bit first; a word is two consecutive int16 of the trellis, low half first.
- Stream position p ends at bit end(p) (end(p) = (p+1)*K; for half-integer K even positions
  carry floor(K) bits and odd ones floor(K)+1). Its 16-bit state is the 16 bits ending there,
  wrapping around the tile. The codebook maps the state to one fp16 value.
- Position p lands at row-major tile element TENSOR_CORE_PERM[p] (the MMA fragment order).
- W = diag(suh) . H . W_hat . H . diag(svh), H the 128-block Sylvester Hadamard scaled by
  1/sqrt(128); the steps run in the same dtypes and with the same torch expressions as
  exllamav3's `LinearEXL3.get_weight_tensor` (fp32 Hadamard products rounded to fp16, the sign
  vectors applied in fp16), so on a GPU the result equals exllamav3's bit for bit.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch

from .format import Exl3Group

HAD_DIM = 128
_HAD_MAX_GEMM_ROWS = 1 << 19  # exllamav3 chunks the right-side product above this many rows
_DECODE_CHUNK_TILES = 1 << 14  # bound the int64 transients of the inner decode


# ---- codebooks -----------------------------------------------------------------------------

def _halves_sum(x: torch.Tensor) -> torch.Tensor:
    """(x & 0x8fff8fff) ^ 0x3b603b60, its two fp16 halves added and rounded once to fp16."""
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = (x & 0xFFFF).to(torch.int16)
    hi = ((x >> 16) & 0xFFFF).to(torch.int16)
    lo_f = lo.view(torch.float16).float()
    hi_f = hi.view(torch.float16).float()
    return (lo_f + hi_f).to(torch.float16)  # the fp32 sum of two fp16 in [1/8, 2) is exact


def _fp16_from_bits(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16)


def _mul1_values(x: torch.Tensor) -> torch.Tensor:
    """Byte sum of the product as fp16 (1024 + sum), then one fp16 fma with 1/147.7 and -10.39."""
    byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
    h = (1024 + byte_sum).double()  # 0x6400 + sum read as fp16 is exactly 1024 + sum
    k_inv = _fp16_from_bits(0x1EEE).double()  # 0.00677 = 1/147.7
    k_bias = _fp16_from_bits(0xC931).double()  # -10.39 = (-1024 - 510) / 147.7
    exact = h * k_inv + k_bias  # exact in fp64 (22-bit product, small exponent spread)
    as_f32 = exact.float()
    if not torch.equal(as_f32.double(), exact):
        raise AssertionError("mul1 codebook: fma result not exact in fp32; rounding would be doubled")
    return as_f32.to(torch.float16)  # the single rounding of __hfma


@lru_cache(maxsize=None)
def _codebook_cpu(codebook: str) -> torch.Tensor:
    state = torch.arange(1 << 16, dtype=torch.int64)
    if codebook == "3inst":
        return _halves_sum((state * 89226354 + 64248484) & 0xFFFFFFFF)
    if codebook == "mcg":
        return _halves_sum((state * 0xCBAC1FED) & 0xFFFFFFFF)
    if codebook == "mul1":
        return _mul1_values((state * 0x83DCD12D) & 0xFFFFFFFF)
    raise ValueError(f"unknown codebook {codebook!r}; known are 3inst, mcg, mul1")


_TABLES: dict[tuple[str, str], torch.Tensor] = {}


def codebook_table(codebook: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """All 65536 fp16 values of a codebook, indexed by the 16-bit trellis state."""
    key = (codebook, str(torch.device(device)))
    if key not in _TABLES:
        _TABLES[key] = _codebook_cpu(codebook).to(device)
    return _TABLES[key]


# ---- stream layout -------------------------------------------------------------------------

def _tensor_core_perm() -> list[int]:
    perm = [0] * 256
    for lane in range(32):
        r0 = (lane % 4) * 2
        c0 = lane // 4
        rows = (r0, r0 + 1, r0 + 8, r0 + 9)
        for j in range(8):
            perm[lane * 8 + j] = rows[j % 4] * 16 + c0 + (8 if j >= 4 else 0)
    return perm


TENSOR_CORE_PERM = _tensor_core_perm()  # stream position -> row-major element of the 16x16 tile


def position_ends(bits: float) -> list[int]:
    """Bit index (exclusive) where each of the 256 stream positions ends."""
    if float(bits).is_integer():
        k = int(bits)
        return [(p + 1) * k for p in range(256)]
    ka = int(bits)
    pair = 2 * ka + 1
    return [(p // 2) * pair + ka if p % 2 == 0 else (p // 2 + 1) * pair for p in range(256)]


def position_bits(bits: float) -> list[int]:
    """Bits each stream position adds (K, or alternating floor(K), floor(K)+1)."""
    ends = position_ends(bits)
    return [ends[0]] + [ends[p] - ends[p - 1] for p in range(1, 256)]


@lru_cache(maxsize=None)
def _window_plan(bits: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: the 32-bit word holding the window's first bit, its last bit, and the shift."""
    total = int(256 * bits)
    n_words = total // 32
    lo, hi, shift = [], [], []
    for end in position_ends(bits):
        e = end + total  # one tile ahead, so the window start is never negative
        i0, i1 = (e - 16) // 32, (e - 1) // 32
        lo.append(i0 % n_words)
        hi.append(i1 % n_words)
        shift.append((i1 + 1) * 32 - e)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return as_t(lo), as_t(hi), as_t(shift)


@lru_cache(maxsize=None)
def _inverse_perm() -> torch.Tensor:
    return torch.argsort(torch.tensor(TENSOR_CORE_PERM, dtype=torch.int64))


def trellis_states(trellis: torch.Tensor, bits: float) -> torch.Tensor:
    """int64 [..., 256]: the 16-bit state of every stream position of every tile."""
    u16 = trellis.to(torch.int64) & 0xFFFF
    words = u16[..., 0::2] | (u16[..., 1::2] << 16)
    lo, hi, shift = (t.to(trellis.device) for t in _window_plan(float(bits)))
    merged = (words[..., lo] << 32) | words[..., hi]
    return (merged >> shift) & 0xFFFF


def decode_rotated(trellis: torch.Tensor, bits: float, codebook: str) -> torch.Tensor:
    """fp16 [in, out] in the rotated basis (W_hat; what exllamav3's `ext.reconstruct` writes)."""
    tiles_in, tiles_out, _ = trellis.shape
    table = codebook_table(codebook, trellis.device)
    inv = _inverse_perm().to(trellis.device)
    out = torch.empty((tiles_in, 16, tiles_out, 16), dtype=torch.float16, device=trellis.device)
    rows_per_chunk = max(1, _DECODE_CHUNK_TILES // max(tiles_out, 1))
    for r in range(0, tiles_in, rows_per_chunk):
        states = trellis_states(trellis[r : r + rows_per_chunk], bits)
        values = table[states][..., inv]  # row-major tile elements
        out[r : r + rows_per_chunk] = values.view(-1, tiles_out, 16, 16).permute(0, 2, 1, 3)
    return out.view(tiles_in * 16, tiles_out * 16)


def fwht(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard (Sylvester order) over 128-blocks of `dim`: seven butterfly stages
    (strides 1 to 64) of sums and differences, elementwise in x's dtype, in that fixed order."""
    x = x.movedim(dim, -1)
    shape = x.shape
    x = x.reshape(-1, HAD_DIM)
    h = 1
    while h < HAD_DIM:
        x = x.view(-1, HAD_DIM // (2 * h), 2, h)
        a, b = x[:, :, 0, :], x[:, :, 1, :]
        x = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return x.reshape(shape).movedim(-1, dim)


# ---- Hadamard and sign vectors (exllamav3's get_weight_tensor, step for step) -------------------

_HADS: dict[str, torch.Tensor] = {}


def hadamard(device: torch.device | str) -> torch.Tensor:
    """fp32 128x128 Sylvester Hadamard times fp32(1/sqrt(128)), built as exllamav3 builds it."""
    key = str(torch.device(device))
    if key not in _HADS:
        h = torch.ones((1, 1), dtype=torch.float16)
        while h.shape[0] < HAD_DIM:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        had = h.to(device=device, dtype=torch.float32, copy=True)
        had *= 1 / math.sqrt(HAD_DIM)
        _HADS[key] = had
    return _HADS[key]


def _had_left(w: torch.Tensor) -> torch.Tensor:
    k, n = w.shape
    x = w.to(torch.float)
    x = (hadamard(w.device) @ x.view(-1, HAD_DIM, n)).view(k, n)
    return x.to(w.dtype)


def _had_right(w: torch.Tensor) -> torch.Tensor:
    k, n = w.shape
    x = w.to(torch.float)
    had = hadamard(w.device)
    rows = max(1, _HAD_MAX_GEMM_ROWS * HAD_DIM // n)
    if rows >= k:
        x = (x.view(k, -1, HAD_DIM) @ had).view(k, n)
    else:
        x = torch.cat([(x[i : i + rows].reshape(-1, HAD_DIM) @ had).view(-1, n) for i in range(0, k, rows)], dim=0)
    return x.to(w.dtype)


def apply_hadamards(w_hat: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """diag(suh) . H . W_hat . H . diag(svh) in exllamav3's order and dtypes; fp16 out."""
    w = _had_left(w_hat)
    w *= suh.to(w.device).unsqueeze(1)
    w = _had_right(w)
    w *= svh.to(w.device).unsqueeze(0)
    return w


@contextmanager
def single_threaded(enabled: bool = True) -> Iterator[None]:
    """Run torch's CPU ops on one thread. Small tensors decode 60x faster so on a loaded machine
    (2 threads at load 12 on 2 cores, measured); results do not depend on the thread count."""
    threads = torch.get_num_threads()
    if enabled and threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


_SMALL = 1 << 22  # weights below this many elements decode single-threaded on the CPU


def decode_weight(group: Exl3Group, device: torch.device | str | None = None) -> torch.Tensor:
    """fp16 W [in_features, out_features] (y = x @ W), exactly as exllamav3 reconstructs it."""
    dev = torch.device(device) if device is not None else group.trellis.device
    small = dev.type == "cpu" and group.in_features * group.out_features < _SMALL
    with single_threaded(small):
        trellis = group.trellis.to(dev)
        w_hat = decode_rotated(trellis, group.bits, group.codebook)
        return apply_hadamards(w_hat, group.suh.to(dev), group.svh.to(dev))


def dequantize_exact(group: Exl3Group) -> torch.Tensor:
    """The weight the format defines, W = diag(suh) . H . W_hat . H . diag(svh) with H the orthonormal
    128-block Hadamard, in fp64 [in_features, out_features]: what the kit's EXL3 products compute
    (glm53/ops/exl3_torch.py), without the fp16 roundings of exllamav3's reconstruction (decode_weight)."""
    w_hat = decode_rotated(group.trellis, group.bits, group.codebook).to(torch.float64)
    k, n = w_hat.shape
    had = hadamard("cpu").to(torch.float64).sign() / math.sqrt(HAD_DIM)
    w = (had @ w_hat.view(-1, HAD_DIM, n)).view(k, n) * group.suh.to(torch.float64)[:, None]
    return (w.view(k, -1, HAD_DIM) @ had).view(k, n) * group.svh.to(torch.float64)[None, :]
