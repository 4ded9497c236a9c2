"""Interleaved rotary position embedding, as GLM-5.3 applies it to the rope slices.

Pairs (x0, x1), (x2, x3), ... rotate by one frequency each; the rotated result is laid out as
[all even outputs | all odd outputs] (the reference's layout). Queries and keys use the same layout,
so dot products are those of the classic interleaved RoPE; the cached rope key is stored this way.
"""
from __future__ import annotations

import torch

from glm53.config import Glm53Config


def inverse_frequencies(cfg: Glm53Config) -> torch.Tensor:
    """fp32 [rope_dim / 2]: theta ** (-2i / rope_dim), 'default' RoPE (the only type GLM-5.3 ships)."""
    dim = cfg.qk_rope_head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def rope_angles(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, rope_dim / 2] for absolute positions; angles in fp32, then cast."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., rope_dim]; cos/sin [T, rope_dim/2] broadcast over the middle dims."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
