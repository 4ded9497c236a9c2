"""GLM-5.3 (`model_type` `glm_moe_dsa`) configuration, read from a checkpoint's config.json.

Field names are those of the Hugging Face config (transformers' GlmMoeDsaConfig), so the same
config.json serves the kit, TensorFold and the transformers reference. Per-layer schedules
(`indexer_types`, `mlp_layer_types`) are resolved here with the same defaults transformers uses,
so every part of the kit agrees on which layer is dense or MoE and which indexer is full or shared.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_TYPE = "glm_moe_dsa"


class ConfigError(ValueError):
    """A config.json the kit cannot serve; the message names the file, the field and the remedy."""


@dataclass(frozen=True)
class Glm53Config:
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288  # dense MLP width
    moe_intermediate_size: int = 2048  # one routed (or shared) expert's width
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    kv_lora_rank: int = 512
    q_lora_rank: int = 2048
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    first_k_dense_replace: int = 3
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0  # transformers default when config.json names none
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # MTP layers stored after the decoder layers
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    indexer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    quantization_config: dict[str, Any] = field(default_factory=dict)
    torch_dtype: str = "bfloat16"

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: the kv latent plus the shared rope key (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    def is_moe_layer(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    def indexer_is_full(self, layer: int) -> bool:
        return self.indexer_types[layer] == "full"

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "Glm53Config":
        def need(name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
            value = raw.get(name, default)
            if value is None:
                raise ConfigError(f"{source}: field '{name}' is missing; a GLM-5.3 config needs it")
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if kind is int and isinstance(value, bool) or not isinstance(value, kind):
                raise ConfigError(
                    f"{source}: field '{name}' is {value!r} ({type(value).__name__}); expected {_kind_name(kind)}"
                )
            return value

        model_type = raw.get("model_type")
        if model_type != MODEL_TYPE:
            raise ConfigError(
                f"{source}: model_type is {model_type!r}; this family serves {MODEL_TYPE!r} (full GLM-5.3). "
                "GLM-5.3-Flash (glm5_next) is served by TensorFold's own family"
            )
        d = cls()
        ints = [
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "n_shared_experts", "n_routed_experts", "num_experts_per_tok", "n_group",
            "topk_group", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "index_topk", "index_head_dim", "index_n_heads", "first_k_dense_replace",
        ]
        values: dict[str, Any] = {name: need(name, int, getattr(d, name)) for name in ints}
        for name in ints:
            if values[name] <= 0 and name not in ("first_k_dense_replace",):
                raise ConfigError(f"{source}: field '{name}' is {values[name]}; it must be positive")
        values["routed_scaling_factor"] = need("routed_scaling_factor", float, d.routed_scaling_factor)
        values["rms_norm_eps"] = need("rms_norm_eps", float, d.rms_norm_eps)
        values["norm_topk_prob"] = need("norm_topk_prob", bool, d.norm_topk_prob)
        values["tie_word_embeddings"] = need("tie_word_embeddings", bool, d.tie_word_embeddings)
        values["max_position_embeddings"] = need("max_position_embeddings", int, d.max_position_embeddings)
        values["num_nextn_predict_layers"] = need("num_nextn_predict_layers", int, 0)
        values["torch_dtype"] = str(raw.get("torch_dtype") or raw.get("dtype") or d.torch_dtype)

        rope = raw.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: field 'rope_parameters' must be an object, got {type(rope).__name__}")
        legacy_scaling = raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or (legacy_scaling.get("type") if isinstance(legacy_scaling, dict) else None)
        if rope_type not in (None, "default"):
            raise ConfigError(
                f"{source}: rope_parameters.rope_type {rope_type!r} is not supported yet (only 'default'); "
                "GLM-5.3 ships default RoPE"
            )
        theta = rope.get("rope_theta", raw.get("rope_theta", d.rope_theta))
        if not isinstance(theta, (int, float)) or theta <= 0:
            raise ConfigError(f"{source}: rope_theta {theta!r} must be a positive number")
        values["rope_theta"] = float(theta)
        values["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}

        eos = raw.get("eos_token_id", 1)
        eos_list = eos if isinstance(eos, list) else [eos]
        if not eos_list or not all(isinstance(t, int) and not isinstance(t, bool) for t in eos_list):
            raise ConfigError(f"{source}: eos_token_id {eos!r} must be an integer or a list of integers")
        values["eos_token_ids"] = tuple(eos_list)
        values["bos_token_id"] = raw.get("bos_token_id")

        n_layers = values["num_hidden_layers"]
        values["mlp_layer_types"] = _mlp_layer_types(raw, n_layers, values["first_k_dense_replace"], source)
        values["indexer_types"] = _indexer_types(raw, n_layers, source)

        if values["num_experts_per_tok"] > values["n_routed_experts"]:
            raise ConfigError(f"{source}: num_experts_per_tok exceeds n_routed_experts")
        if values["n_routed_experts"] % values["n_group"] != 0:
            raise ConfigError(f"{source}: n_routed_experts must divide evenly into n_group groups")
        qc = raw.get("quantization_config") or {}
        if not isinstance(qc, dict):
            raise ConfigError(f"{source}: quantization_config must be an object")
        values["quantization_config"] = qc
        return cls(**values)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Glm53Config":
        path = Path(model_dir) / "config.json"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found; is {model_dir} a GLM-5.3 checkpoint folder?") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read ({exc.strerror}); check permissions") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); re-download it") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: must hold a JSON object")
        return cls.from_dict(raw, source=str(path))


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _mlp_layer_types(raw: dict[str, Any], n_layers: int, n_dense: int, source: str) -> tuple[str, ...]:
    given = raw.get("mlp_layer_types")
    if given is None:
        n_dense = min(n_dense, n_layers)
        return tuple(["dense"] * n_dense + ["sparse"] * (n_layers - n_dense))
    if not isinstance(given, list) or len(given) != n_layers or any(t not in ("dense", "sparse") for t in given):
        raise ConfigError(f"{source}: mlp_layer_types must list 'dense'/'sparse' for each of {n_layers} layers")
    return tuple(given)


def _indexer_types(raw: dict[str, Any], n_layers: int, source: str) -> tuple[str, ...]:
    """'full' layers run their own top-k; 'shared' layers reuse the previous full layer's selection."""
    given = raw.get("indexer_types")
    if given is None:
        pattern = raw.get("index_topk_pattern")
        if pattern is not None:
            given = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq = max(int(raw.get("index_topk_freq", 1)), 1)
            offset = int(raw.get("index_skip_topk_offset", 2))
            given = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n_layers)]
    if not isinstance(given, list) or len(given) != n_layers or any(t not in ("full", "shared") for t in given):
        raise ConfigError(f"{source}: indexer_types must list 'full'/'shared' for each of {n_layers} layers")
    if given and given[0] != "full":
        raise ConfigError(f"{source}: indexer_types[0] is 'shared' but no earlier full layer exists to share from")
    return tuple(given)
