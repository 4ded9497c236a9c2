"""Synthetic GLM-5.3 checkpoints with real tensor names: for tests and benchmarks of the verifier/layout.

Header-true, data-arbitrary: every tensor has the name, dtype and shape a GLM-5.3 EXL3 pack gives
it (at the dimensions of the config passed in), the shards are valid safetensors with an index and a
config.json; the data is random bytes, or holes (`sparse=True`, for real-size benchmarks: a 300 GiB
checkpoint that takes no disk). This is not the kit's tiny *model* checkpoint (glm53.synthetic.tiny makes that,
with weights that run); this one exists to exercise file handling at any size.

Which linears the real 3.38 bpw pack quantizes is not known here; by default every attention
projection and MLP linear of the decoder layers is EXL3 (routed experts at mixed widths), stored as
exllamav3 stores it (features padded to multiples of 128), while embeddings, norms, the router and the
indexer stay in 16/32-bit. glm53/formats/checkpoint_rules.py says which linears may be EXL3 and why (exllamav3
keeps kv_b_proj in fp16 and quantizes the indexer's wq_b; the rule accepts either form of both).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from glm53.formats.checkpoint_rules import pad_features
from glm53.config import Glm53Config
from glm53.formats.safetensors_header import DTYPE_BITS

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_BITS[self.dtype]
        for d in self.shape:
            n *= d
        return n // 8


ExpertBits = Callable[[int, int, str], float]  # (layer, expert, projection) -> K


def default_expert_bits(layer: int, expert: int, proj: str) -> float:
    """A deterministic 2/3/4-bit mix (10/50/40 %, 3.3 bits on average, like a ~3.4 bpw MixedK pack)."""
    h = (layer * 7919 + expert * 104729 + {"gate_proj": 1, "up_proj": 2, "down_proj": 3}[proj] * 13) % 10
    return 2.0 if h < 1 else 4.0 if h >= 6 else 3.0


def exl3_linear(prefix: str, in_f: int, out_f: int, bits: float, codebook: str = "mcg") -> list[TensorSpec]:
    """An EXL3 group as exllamav3 stores it: features padded to multiples of 128 (checkpoint_rules)."""
    words = int(round(bits * 16))
    in_f, out_f = pad_features(in_f), pad_features(out_f)
    specs = [
        TensorSpec(f"{prefix}.trellis", "I16", (in_f // 16, out_f // 16, words)),
        TensorSpec(f"{prefix}.suh", "F16", (in_f,)),
        TensorSpec(f"{prefix}.svh", "F16", (out_f,)),
    ]
    if codebook != "3inst":
        specs.append(TensorSpec(f"{prefix}.{codebook}", "I32", ()))
    return specs


def plain_linear(prefix: str, in_f: int, out_f: int, dtype: str = "BF16") -> list[TensorSpec]:
    return [TensorSpec(f"{prefix}.weight", dtype, (out_f, in_f))]


def glm53_tensor_specs(
    cfg: Glm53Config,
    *,
    expert_bits: ExpertBits = default_expert_bits,
    attn_exl3: bool = True,
    attn_bits: float = 4.0,
    mlp_bits: float = 4.0,
    codebook: str = "mcg",
) -> Iterator[TensorSpec]:
    """Every tensor of a GLM-5.3 EXL3 pack for `cfg`, in checkpoint order (layers ascending)."""
    h = cfg.hidden_size

    def linear(prefix: str, in_f: int, out_f: int, bits: float, exl3: bool = True) -> list[TensorSpec]:
        return exl3_linear(prefix, in_f, out_f, bits, codebook) if exl3 else plain_linear(prefix, in_f, out_f)

    yield TensorSpec("model.embed_tokens.weight", "BF16", (cfg.vocab_size, h))
    n_total = cfg.num_hidden_layers + cfg.num_mtp_layers
    for i in range(n_total):
        p = f"model.layers.{i}"
        is_mtp = i >= cfg.num_hidden_layers
        if is_mtp:
            yield TensorSpec(f"{p}.embed_tokens.weight", "BF16", (cfg.vocab_size, h))
            yield TensorSpec(f"{p}.enorm.weight", "BF16", (h,))
            yield TensorSpec(f"{p}.hnorm.weight", "BF16", (h,))
            yield TensorSpec(f"{p}.eh_proj.weight", "BF16", (h, 2 * h))
        yield TensorSpec(f"{p}.input_layernorm.weight", "BF16", (h,))
        yield TensorSpec(f"{p}.post_attention_layernorm.weight", "BF16", (h,))
        a = f"{p}.self_attn"
        heads = cfg.num_attention_heads
        yield from linear(f"{a}.q_a_proj", h, cfg.q_lora_rank, attn_bits, attn_exl3)
        yield TensorSpec(f"{a}.q_a_layernorm.weight", "BF16", (cfg.q_lora_rank,))
        yield from linear(f"{a}.q_b_proj", cfg.q_lora_rank, heads * cfg.qk_head_dim, attn_bits, attn_exl3)
        yield from linear(f"{a}.kv_a_proj_with_mqa", h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, attn_bits, attn_exl3)
        yield TensorSpec(f"{a}.kv_a_layernorm.weight", "BF16", (cfg.kv_lora_rank,))
        yield from linear(f"{a}.kv_b_proj", cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), attn_bits, attn_exl3)
        yield from linear(f"{a}.o_proj", heads * cfg.v_head_dim, h, attn_bits, attn_exl3)
        layer_for_schedule = min(i, cfg.num_hidden_layers - 1)
        if is_mtp or cfg.indexer_is_full(layer_for_schedule):
            x = f"{a}.indexer"
            yield TensorSpec(f"{x}.wq_b.weight", "BF16", (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank))
            yield TensorSpec(f"{x}.wk.weight", "BF16", (cfg.index_head_dim, h))
            yield TensorSpec(f"{x}.k_norm.weight", "BF16", (cfg.index_head_dim,))
            yield TensorSpec(f"{x}.k_norm.bias", "BF16", (cfg.index_head_dim,))
            yield TensorSpec(f"{x}.weights_proj.weight", "BF16", (cfg.index_n_heads, h))
        m = f"{p}.mlp"
        if not is_mtp and not cfg.is_moe_layer(i):
            for proj, (i_f, o_f) in _mlp_dims(h, cfg.intermediate_size).items():
                yield from linear(f"{m}.{proj}", i_f, o_f, mlp_bits)
            continue
        yield TensorSpec(f"{m}.gate.weight", "BF16", (cfg.n_routed_experts, h))
        yield TensorSpec(f"{m}.gate.e_score_correction_bias", "F32", (cfg.n_routed_experts,))
        for e in range(cfg.n_routed_experts):
            for proj, (i_f, o_f) in _mlp_dims(h, cfg.moe_intermediate_size).items():
                yield from exl3_linear(f"{m}.experts.{e}.{proj}", i_f, o_f, expert_bits(i, e, proj), codebook)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        for proj, (i_f, o_f) in _mlp_dims(h, shared).items():
            yield from linear(f"{m}.shared_experts.{proj}", i_f, o_f, mlp_bits)
        if is_mtp:
            yield TensorSpec(f"{p}.shared_head.norm.weight", "BF16", (h,))
            yield TensorSpec(f"{p}.shared_head.head.weight", "BF16", (cfg.vocab_size, h))
    yield TensorSpec("model.norm.weight", "BF16", (h,))
    if not cfg.tie_word_embeddings:
        yield TensorSpec("lm_head.weight", "BF16", (cfg.vocab_size, h))


def _mlp_dims(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def split_into_shards(specs: list[TensorSpec], n_shards: int) -> list[list[TensorSpec]]:
    """Contiguous groups of roughly equal bytes, in order (the way exporters fill shards)."""
    total = sum(s.nbytes for s in specs)
    shards: list[list[TensorSpec]] = [[] for _ in range(n_shards)]
    done = 0
    for s in specs:
        k = min(n_shards - 1, done * n_shards // max(total, 1))
        shards[k].append(s)
        done += s.nbytes
    return [s for s in shards if s]


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length plus the space-padded JSON header for `specs` laid out in order."""
    doc: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for s in specs:
        doc[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_shard(path: Path, specs: list[TensorSpec], *, sparse: bool = False, rng: np.random.Generator | None = None) -> int:
    """Write one shard; with `sparse` the data region is a hole (no disk blocks). Returns its size."""
    head = header_bytes(specs)
    data_len = sum(s.nbytes for s in specs)
    with open(path, "wb") as f:
        f.write(head)
        if sparse:
            f.truncate(len(head) + data_len)
        else:
            rng = rng or np.random.default_rng(0)
            left = data_len
            while left:
                n = min(left, 1 << 24)
                f.write(rng.bytes(n))
                left -= n
    return len(head) + data_len


def write_checkpoint(
    out_dir: str | Path,
    config: dict[str, Any],
    *,
    n_shards: int = 4,
    sparse: bool = False,
    seed: int = 0,
    specs: list[TensorSpec] | None = None,
    **spec_options: Any,
) -> Path:
    """Write config.json, the shards and the index for `config` (a config.json dict) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = Glm53Config.from_dict(config)
    specs = specs if specs is not None else list(glm53_tensor_specs(cfg, **spec_options))
    groups = split_into_shards(specs, n_shards)
    rng = np.random.default_rng(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for k, group in enumerate(groups):
        name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        write_shard(out / name, group, sparse=sparse, rng=rng)
        for s in group:
            weight_map[s.name] = name
            total += s.nbytes
    (out / "config.json").write_text(json.dumps(config, indent=2))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=1))
    return out


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A small GLM-5.3-shaped config.json dict whose block counts exercise 3- and 4-rank splits."""
    raw: dict[str, Any] = {
        "model_type": "glm_moe_dsa",
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 768,  # 6 blocks of 128
        "moe_intermediate_size": 512,  # 4 blocks of 128: over 3 ranks 2/1/1 rotating
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "kv_lora_rank": 128,
        "q_lora_rank": 128,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
        "index_topk": 8,
        "index_head_dim": 64,
        "index_n_heads": 2,
        "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 1,
        "indexer_types": ["full", "shared", "full", "shared"],
        "max_position_embeddings": 4096,
    }
    raw.update(overrides)
    return raw


def real_config(**overrides: Any) -> dict[str, Any]:
    """GLM-5.3's published dimensions as config.json fields; the 3.38 bpw pack has no MTP."""
    raw: dict[str, Any] = {"model_type": "glm_moe_dsa", "num_nextn_predict_layers": 0}
    raw.update(overrides)
    return raw


def apparent_and_allocated(path: Path) -> tuple[int, int]:
    """(apparent size, bytes on disk) of a file: a sparse file has the second far below the first."""
    st = os.stat(path)
    return st.st_size, st.st_blocks * 512
