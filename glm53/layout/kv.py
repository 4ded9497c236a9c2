"""KV-cache bytes per rank at a context length, with decode context parallelism (DCP) on or off.

What a GLM-5.3 layer caches per token (transformers' glm_moe_dsa, DeepSeek-V3.2 style MLA + DSA):
- the MLA latent: kv_lora_rank (512) + qk_rope_head_dim (64) = 576 values, on every layer;
- the indexer key: index_head_dim (128) values, on `full` indexer layers only. `shared` layers have
  no indexer (they reuse the previous full layer's top-k), so they store no indexer keys;
- MTP layers (num_nextn_predict_layers) are full attention layers with their own indexer and cache.
The latent is not split by head, so tensor parallelism does not divide it: without DCP every rank
holds every position; with DCP position p lives on rank p % R, so rank r holds ceil((T - r) / R).

Storage formats (`kv_dtype`), exactly what glm53.model.kv_state.KVState allocates (glm53.kv_format.row_bytes):
- "bf16": 2 bytes a value: 1152 bytes of latent and 256 of indexer key per token and layer;
- "fp8": e4m3 values with one fp32 scale per row: 576 + 4 = 580 bytes of latent, 128 + 4 = 132
  of indexer key. (FlashMLA's fp8 layout, a scale per 128 latent values and the rope part in
  bf16, is 656 bytes; a GPU kernel that needs it will change KVState and this count together.)
"""
from __future__ import annotations

from dataclasses import dataclass

from glm53.config import Glm53Config
from glm53.kv_format import SERVING_KV_DTYPES, row_bytes

KV_DTYPES = SERVING_KV_DTYPES


@dataclass(frozen=True)
class KvTokenBytes:
    latent: int  # bytes per token per attention layer
    indexer: int  # bytes per token per full-indexer layer
    attention_layers: int
    indexer_layers: int

    @property
    def per_token(self) -> int:
        """Bytes one token position costs across all layers on the rank that holds it."""
        return self.latent * self.attention_layers + self.indexer * self.indexer_layers


def kv_token_bytes(config: Glm53Config, kv_dtype: str = "bf16", include_mtp: bool = True) -> KvTokenBytes:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
    latent = row_bytes(config.kv_lora_rank + config.qk_rope_head_dim, kv_dtype)
    indexer = row_bytes(config.index_head_dim, kv_dtype)
    mtp = config.num_mtp_layers if include_mtp else 0
    full = sum(1 for i in range(config.num_hidden_layers) if config.indexer_is_full(i)) + mtp
    return KvTokenBytes(latent, indexer, config.num_hidden_layers + mtp, full)


def positions_per_rank(context_tokens: int, ranks: int, dcp: bool = True) -> list[int]:
    """Token positions each rank stores: p on rank p % R with DCP, all of them without."""
    if ranks < 1 or context_tokens < 0:
        raise ValueError(f"need ranks >= 1 and context_tokens >= 0 (got {ranks}, {context_tokens})")
    if not dcp:
        return [context_tokens] * ranks
    return [max(0, -(-(context_tokens - r) // ranks)) for r in range(ranks)]


def kv_bytes_per_rank(
    config: Glm53Config,
    context_tokens: int,
    ranks: int,
    *,
    dcp: bool = True,
    kv_dtype: str = "bf16",
    include_mtp: bool = True,
) -> list[int]:
    """KV-cache bytes (latent + indexer keys, all layers) each rank holds for one sequence of
    `context_tokens` tokens."""
    per_token = kv_token_bytes(config, kv_dtype, include_mtp).per_token
    return [n * per_token for n in positions_per_rank(context_tokens, ranks, dcp)]
