"""An empty KV cache with GLM-5.3's row sizes, for the benches that store and restore rows without
the model: bf16 latents of 576 on every layer, indexer keys of 128 on every other ('full') layer."""
from __future__ import annotations

from glm53.model.kv_state import KVState


def new_kv_state(layers: int, device: str) -> KVState:
    return KVState(n_layers=layers, latent_dim=576, index_dim=128, indexed_layers=frozenset(range(0, layers, 2)),
                   kv_dtype="bf16", device=device)
