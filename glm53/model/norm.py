"""Normalizations with the reference's rounding points (statistics in fp32, scale in the weight's dtype)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# transformers 5.23 builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps (1e-6), not
# config.rms_norm_eps (1e-5 for GLM-5.3); vLLM/SGLang's DeepSeek-style MLA use config.rms_norm_eps.
# We follow the reference by default (see ENGINE.md, "Where we differ from / question the reference").
LORA_NORM_EPS = 1e-6
INDEXER_KEY_NORM_EPS = 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
