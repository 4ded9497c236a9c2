"""Normalizations with the reference's rounding points (statistics in fp32, scale in the weight's
dtype), computed row-invariantly by glm53.ops."""
from __future__ import annotations

from glm53.ops import layer_norm, rms_norm

# transformers 5.23 builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps (1e-6), not
# config.rms_norm_eps (1e-5 for GLM-5.3); vLLM/SGLang's DeepSeek-style MLA use config.rms_norm_eps.
# We follow the reference by default (see docs/engine.md, "Where the kit departs from the reference").
LORA_NORM_EPS = 1e-6
INDEXER_KEY_NORM_EPS = 1e-6

__all__ = ["INDEXER_KEY_NORM_EPS", "LORA_NORM_EPS", "layer_norm", "rms_norm"]
