"""A tiny GLM-5.3-architecture checkpoint (`model_type` glm_moe_dsa) for tests, written deterministically.

    python -m glm53.synthetic.tiny OUT_DIR [--seed N] [--reference REF_DIR] [--exl3-all]

Every feature of the real model at toy size: MLA with interleaved RoPE, sparse-attention indexer
layers both `full` and `shared` (index_topk 32, below test contexts), one dense and three MoE
decoder layers plus one MTP layer (DeepSeek-V3 style, stored as layer `num_hidden_layers` with
enorm/hnorm/eh_proj/shared_head.norm), a shared expert, and routed experts in EXL3 at mixed widths
(K = 2, 2.5, 3, 3.5, 4 across experts and projections; codebooks 3inst, mcg and mul1). The rest is
bf16. Several shards with model.safetensors.index.json; quantization_config (config.json) and
quantization_config.json with per-module `tensor_storage`; a byte-level BPE tokenizer with GLM's
chat special tokens and template; generation_config.json. Same seed, same bytes.

`--exl3-all` also stores as EXL3 every linear that glm53/formats/checkpoint_rules.py lets be EXL3 (the
attention projections, the indexer's wq_b, the dense MLP, the shared expert, MTP's eh_proj: the
layout of an exllamav3 pack), each zero-padded to multiples of 128 as exllamav3 pads it before
encoding (kv_a's 80 outputs and kv_b's 64 inputs become 128).

Dimensions let the TP layout split everything over 2, 3 or 4 ranks: hidden 256 (a multiple of the
EXL3 Hadamard block), 8 heads, experts 512 wide (4 blocks of 128), dense MLP 1024 (8 blocks).

`--reference REF_DIR` writes the same model with every EXL3 tensor dequantized into plain fp32
weights: the matrix the format defines (diag(suh) H W_hat H diag(svh), computed in fp64 and rounded
once; the kit's EXL3 products compute exactly that), padding trimmed to the config's features. It
is laid out for transformers' GlmMoeDsaForCausalLM.from_pretrained
(per-expert keys, which transformers fuses on load), without quantization_config. The MTP layer is
left out of its index (transformers has no MTP module and would warn about it); its decoded
tensors go to `mtp.safetensors` beside it.

Exit codes: 0 written; 2 bad arguments or output folder not empty (click's usage error, on stderr).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
import zlib
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

import click
import torch
from safetensors.torch import save_file

from glm53.formats.checkpoint_rules import LinearRule, linear_dims
from glm53.config import Glm53Config
from glm53.exl3.decode import dequantize_exact
from glm53.exl3.encode import encode_weights, single_threaded
from glm53.exl3.format import read_group
from .tiny_tokenizer import VOCAB_SIZE, write_tokenizer

NUM_HIDDEN_LAYERS = 4
MTP_LAYER = NUM_HIDDEN_LAYERS  # stored as model.layers.4
N_EXPERTS = 8
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "moe_intermediate_size": 512,
    "num_hidden_layers": NUM_HIDDEN_LAYERS,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "n_shared_experts": 1,
    "n_routed_experts": N_EXPERTS,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "head_dim": 16,
    "index_topk": 32,
    "index_head_dim": 32,
    "index_n_heads": 4,
    "indexer_types": ["full", "shared", "full", "shared"],
    "first_k_dense_replace": 1,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "num_nextn_predict_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

# With exl3_all, every other linear that may be EXL3: one width and codebook (exllamav3 gives
# attention and the shared expert extra bits; 4 keeps the tiny model's error small)
ALL_LINEARS_QUANT = (4.0, "mcg")

# Routed experts' widths and codebooks: a fixed schedule that covers every K and codebook, varies
# across experts and across one expert's projections, and differs between layers.
_INTEGER_BITS = (2, 3, 4)
_CODEBOOKS = ("3inst", "mcg", "mul1")


def expert_quant(layer: int, expert: int, proj: int) -> tuple[float, str]:
    """(K, codebook) of routed expert `expert`'s projection `proj` (0 gate, 1 up, 2 down) in `layer`."""
    if expert == N_EXPERTS - 1:  # the last expert of every layer carries the half-integer rates
        return (2.5 if proj < 2 else 3.5), "mul1"
    bits = _INTEGER_BITS[(layer + expert + proj) % 3]
    codebook = _CODEBOOKS[(layer + expert // 2 + proj) % 3]  # one width spans several codebooks
    return float(bits), codebook


# ---- weights ---------------------------------------------------------------------------------

def _randn(name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """Per-name generator: a tensor's values depend only on (seed, name), not on write order."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFFFFFF)
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _norm(name: str, n: int, seed: int) -> torch.Tensor:
    return 1.0 + _randn(name, (n,), seed, 0.05)


def _linear(name: str, out_f: int, in_f: int, seed: int) -> torch.Tensor:
    """nn.Linear layout [out, in], std 1/sqrt(in) so activations keep their scale through the layers."""
    return _randn(name, (out_f, in_f), seed, in_f**-0.5)


def _attention(p: str, layer: int, cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    h, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    q_rank, kv_rank = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    t = {
        f"{p}.q_a_proj.weight": _linear(f"{p}.q_a_proj", q_rank, h, seed),
        f"{p}.q_a_layernorm.weight": _norm(f"{p}.q_a_layernorm", q_rank, seed),
        f"{p}.q_b_proj.weight": _linear(f"{p}.q_b_proj", n_heads * (nope + rope), q_rank, seed),
        f"{p}.kv_a_proj_with_mqa.weight": _linear(f"{p}.kv_a_proj_with_mqa", kv_rank + rope, h, seed),
        f"{p}.kv_a_layernorm.weight": _norm(f"{p}.kv_a_layernorm", kv_rank, seed),
        f"{p}.kv_b_proj.weight": _linear(f"{p}.kv_b_proj", n_heads * (nope + v), kv_rank, seed),
        f"{p}.o_proj.weight": _linear(f"{p}.o_proj", h, n_heads * v, seed),
    }
    if cfg["indexer_types"][min(layer, cfg["num_hidden_layers"] - 1)] == "full" or layer >= cfg["num_hidden_layers"]:
        i = f"{p}.indexer"
        ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
        t.update({
            f"{i}.wq_b.weight": _linear(f"{i}.wq_b", ih * idim, q_rank, seed),
            f"{i}.wk.weight": _linear(f"{i}.wk", idim, h, seed),
            f"{i}.k_norm.weight": _norm(f"{i}.k_norm", idim, seed),
            f"{i}.k_norm.bias": _randn(f"{i}.k_norm.bias", (idim,), seed, 0.02),
            f"{i}.weights_proj.weight": _linear(f"{i}.weights_proj", ih, h, seed),
        })
    return t


def _mlp(p: str, width: int, cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    h = cfg["hidden_size"]
    return {
        f"{p}.gate_proj.weight": _linear(f"{p}.gate_proj", width, h, seed),
        f"{p}.up_proj.weight": _linear(f"{p}.up_proj", width, h, seed),
        f"{p}.down_proj.weight": _linear(f"{p}.down_proj", h, width, seed),
    }


def _layer_plain(layer: int, cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Everything of a decoder layer except routed experts (bf16 later; router bias fp32)."""
    p = f"model.layers.{layer}"
    h = cfg["hidden_size"]
    t = {
        f"{p}.input_layernorm.weight": _norm(f"{p}.input_layernorm", h, seed),
        f"{p}.post_attention_layernorm.weight": _norm(f"{p}.post_attention_layernorm", h, seed),
        **_attention(f"{p}.self_attn", layer, cfg, seed),
    }
    sparse = layer >= cfg["num_hidden_layers"] or cfg["mlp_layer_types"][layer] == "sparse"
    if not sparse:
        t.update(_mlp(f"{p}.mlp", cfg["intermediate_size"], cfg, seed))
        return t
    t.update(_mlp(f"{p}.mlp.shared_experts", cfg["moe_intermediate_size"] * cfg["n_shared_experts"], cfg, seed))
    t[f"{p}.mlp.gate.weight"] = _randn(f"{p}.mlp.gate", (cfg["n_routed_experts"], h), seed, h**-0.5)
    t[f"{p}.mlp.gate.e_score_correction_bias"] = _randn(f"{p}.mlp.gate.bias", (cfg["n_routed_experts"],), seed, 0.1)
    if layer >= cfg["num_hidden_layers"]:  # MTP: DeepSeek-V3 naming
        t[f"{p}.enorm.weight"] = _norm(f"{p}.enorm", h, seed)
        t[f"{p}.hnorm.weight"] = _norm(f"{p}.hnorm", h, seed)
        t[f"{p}.eh_proj.weight"] = _linear(f"{p}.eh_proj", h, 2 * h, seed)
        t[f"{p}.shared_head.norm.weight"] = _norm(f"{p}.shared_head.norm", h, seed)
    return t


def _moe_layers(cfg: dict[str, Any]) -> list[int]:
    layers = [i for i, t in enumerate(cfg["mlp_layer_types"]) if t == "sparse"]
    return layers + list(range(cfg["num_hidden_layers"], cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]))


@lru_cache(maxsize=2)
def _experts_exl3(seed: int) -> Mapping[str, torch.Tensor]:
    """All routed experts of every MoE layer (MTP included) as EXL3 groups, encoded per (K, codebook).
    Most of the writer's time; kept (read-only) so a process writing both variants encodes them once."""
    cfg = TINY_CONFIG
    h, width = cfg["hidden_size"], cfg["moe_intermediate_size"]
    jobs: dict[tuple[float, str], list[tuple[str, torch.Tensor]]] = {}
    for layer in _moe_layers(cfg):
        for e in range(cfg["n_routed_experts"]):
            for j, proj in enumerate(PROJECTIONS):
                prefix = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                in_f, out_f = (h, width) if proj != "down_proj" else (width, h)
                w_in_out = _linear(prefix, out_f, in_f, seed).t().contiguous()
                jobs.setdefault(expert_quant(layer, e, j), []).append((prefix, w_in_out))
    tensors: dict[str, torch.Tensor] = {}
    for (bits, codebook), items in sorted(jobs.items()):
        group_seed = seed * 7919 + int(bits * 2) * 31 + _CODEBOOKS.index(codebook)
        encoded = encode_weights([w for _, w in items], bits, codebook, seed=group_seed)
        for (prefix, _), parts in zip(items, encoded):
            tensors.update({f"{prefix}.{k}": v for k, v in parts.items()})
    return MappingProxyType(tensors)


def _linears_exl3(plain: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every plain linear the rule lets be EXL3 (glm53/formats/checkpoint_rules.py), encoded at ALL_LINEARS_QUANT
    from its fp32 weight zero-padded to multiples of 128 as exllamav3 pads it: trellis
    [pad(in)/16, pad(out)/16, 16K], the padded inputs' rows and outputs' columns zero."""
    items = []
    for prefix, rule in sorted(linear_features(plain).items()):
        if rule.exl3 and f"{prefix}.weight" in plain:
            pin, pout = rule.padded()
            w_in_out = torch.zeros(pin, pout)
            w_in_out[: rule.in_f, : rule.out_f] = plain[f"{prefix}.weight"].t()
            items.append((prefix, w_in_out))
    bits, codebook = ALL_LINEARS_QUANT
    encoded = encode_weights([w for _, w in items], bits, codebook, seed=seed * 7919 + 1)
    return {f"{prefix}.{k}": v for (prefix, _), parts in zip(items, encoded) for k, v in parts.items()}


def linear_features(names: Iterable[str]) -> dict[str, LinearRule]:
    """prefix -> the rule's LinearRule (config features, may it be EXL3) for the tiny model's linears."""
    return linear_dims(Glm53Config.from_dict(TINY_CONFIG), names)


def build_tensors(seed: int = 0, *, exl3_all: bool = False) -> dict[str, torch.Tensor]:
    """All checkpoint tensors by name: EXL3 experts as stored; the rest bf16 (router bias fp32).
    `exl3_all`: every linear that may be EXL3 is (attention, indexer wq_b, MLPs, MTP's eh_proj)."""
    cfg = TINY_CONFIG
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    plain: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": _randn("model.embed_tokens", (vocab, h), seed, 1.0),
        "model.norm.weight": _norm("model.norm", h, seed),
        "lm_head.weight": _linear("lm_head", vocab, h, seed),
    }
    for layer in range(cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]):
        plain.update(_layer_plain(layer, cfg, seed))
    quantized = _linears_exl3(plain, seed) if exl3_all else {}
    replaced = {f"{n.rsplit('.', 1)[0]}.weight" for n in quantized}
    out = {k: (v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16))
           for k, v in plain.items() if k not in replaced}
    out.update(quantized)
    out.update(_experts_exl3(seed))
    return out


# ---- files -----------------------------------------------------------------------------------

def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def _shard_of(name: str) -> int:
    """Shard 1: embeddings and layers 0-1; 2: layer 2; 3: layer 3, final norm, head; 4: MTP."""
    layer = _layer_of(name)
    if layer is None:
        return 1 if name.startswith("model.embed_tokens") else 3
    return {0: 1, 1: 1, 2: 2, 3: 3}.get(layer, 4)


def _write_shards(out: Path, tensors: dict[str, torch.Tensor], shard_of, n_shards: int) -> dict[str, str]:
    names = [f"model-{i:05d}-of-{n_shards:05d}.safetensors" for i in range(1, n_shards + 1)]
    weight_map: dict[str, str] = {}
    for i, fname in enumerate(names, start=1):
        part = {k: v.contiguous() for k, v in sorted(tensors.items()) if shard_of(k) == i}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)
    return weight_map


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _module_storage(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], float]:
    """quantization_config.json's tensor_storage (exllamav3's shape), and the EXL3 average bits."""
    modules: dict[str, dict[str, Any]] = {}
    for name, t in sorted(tensors.items()):
        module = name.rsplit(".", 1)[0]
        entry = modules.setdefault(module, {"stored_tensors": {}})
        entry["stored_tensors"][name] = {
            "shape": list(t.shape), "n_bytes": t.numel() * t.element_size(), "dtype": str(t.dtype).removeprefix("torch."),
        }
    weights = bits_sum = 0.0
    for module, entry in modules.items():
        trellis = entry["stored_tensors"].get(f"{module}.trellis")
        if trellis is None:
            continue
        bits = trellis["shape"][-1] / 16
        entry["quant_format"] = "exl3"
        entry["bits_per_weight"] = int(bits) if float(bits).is_integer() else bits
        if f"{module}.mcg" in entry["stored_tensors"]:
            entry["mcg_multiplier"] = 0xCBAC1FED
        if f"{module}.mul1" in entry["stored_tensors"]:
            entry["mul1_multiplier"] = 0x83DCD12D
        n = trellis["shape"][0] * trellis["shape"][1] * 256
        weights += n
        bits_sum += n * bits
    return modules, round(bits_sum / max(weights, 1), 4)


def _check_target(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise click.UsageError(f"{out_dir}: exists and is not an empty folder; remove it or choose another")


def _staging(out_dir: Path) -> Path:
    stage = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    return stage


def _publish(stage: Path, out_dir: Path) -> None:
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked before staging)
    os.replace(stage, out_dir)


def write_tiny_checkpoint(out_dir: str | Path, *, seed: int = 0, reference_dir: str | Path | None = None,
                          exl3_all: bool = False) -> Path:
    """Write the tiny checkpoint to `out_dir` (and its decoded twin to `reference_dir`); returns out_dir.
    `exl3_all`: every linear that may be EXL3 is (build_tensors); the default stores only routed experts so.

    Each folder is assembled under a hidden sibling and renamed into place when complete.
    """
    with single_threaded():
        return _write_tiny_checkpoint(Path(out_dir), seed, Path(reference_dir) if reference_dir is not None else None,
                                      exl3_all)


def _write_tiny_checkpoint(out: Path, seed: int, ref: Path | None, exl3_all: bool) -> Path:
    for target in (out, ref):
        if target is not None:
            _check_target(target)
    if ref is not None and ref.resolve() == out.resolve():
        raise click.UsageError(f"{ref}: the reference folder must differ from the checkpoint folder")
    stage = _staging(out)
    ref_stage = _staging(ref) if ref is not None else None
    try:
        tensors = build_tensors(seed, exl3_all=exl3_all)
        _write_shards(stage, tensors, _shard_of, 4)
        ids = write_tokenizer(stage)
        storage, avg_bits = _module_storage(tensors)
        qcfg = {"quant_method": "exl3", "version": "0.0.30", "bits": avg_bits, "head_bits": 16}
        config = {**TINY_CONFIG, **ids, "quantization_config": qcfg}
        _write_json(stage / "config.json", config)
        _write_json(stage / "quantization_config.json", {**qcfg, "tensor_storage": storage})
        generation = {"_from_model_config": False, **ids, "do_sample": False, "temperature": 1.0, "top_p": 1.0}
        _write_json(stage / "generation_config.json", generation)
        if ref_stage is not None:
            _write_reference(ref_stage, tensors, {**TINY_CONFIG, **ids}, generation, stage)
            _publish(ref_stage, ref)  # type: ignore[arg-type]
        _publish(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if ref_stage is not None:
            shutil.rmtree(ref_stage, ignore_errors=True)
        raise
    return out


def decoded_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain weights: every EXL3 group as the weight the format defines (decode.dequantize_exact, fp64
    rounded once to fp32) in nn.Linear's [out, in], its
    padding trimmed to the config's features (padded inputs meet zeros; padded outputs are dropped);
    others as is."""
    plain: dict[str, torch.Tensor] = {}
    prefixes = sorted({n.rsplit(".", 1)[0] for n in tensors if n.endswith(".trellis")})
    features = linear_features(tensors)
    for prefix in prefixes:
        w = dequantize_exact(read_group(tensors, prefix))  # [in, out], y = x @ w
        rule = features[prefix]
        plain[f"{prefix}.weight"] = w[: rule.in_f, : rule.out_f].float().t().contiguous()
    exl3_parts = {f"{p}.{s}" for p in prefixes for s in ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")}
    plain.update({k: v for k, v in tensors.items() if k not in exl3_parts})
    return plain


def _write_reference(
    ref: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], generation: dict[str, Any], tok_src: Path
) -> None:
    plain = decoded_tensors(tensors)
    mtp = {k: v for k, v in plain.items() if _layer_of(k) == MTP_LAYER}
    main = {k: v for k, v in plain.items() if _layer_of(k) != MTP_LAYER}
    _write_shards(ref, main, lambda k: 2 if (_layer_of(k) or 0) >= 2 or k in ("model.norm.weight", "lm_head.weight") else 1, 2)
    save_file(dict(sorted(mtp.items())), str(ref / "mtp.safetensors"), metadata={"format": "pt"})
    _write_json(ref / "config.json", {**config, "torch_dtype": "float32"})
    _write_json(ref / "generation_config.json", generation)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_src / name, ref / name)


@click.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Weights seed; same seed, same bytes.")
@click.option("--reference", "reference_dir", type=click.Path(path_type=Path), default=None,
              help="Also write the decoded fp32 twin for transformers here.")
@click.option("--exl3-all", "exl3_all", is_flag=True,
              help="Store every linear that may be EXL3 as EXL3 (attention, indexer wq_b, MLPs, MTP), not only routed experts.")
def main(out_dir: Path, seed: int, reference_dir: Path | None, exl3_all: bool) -> None:
    """Write the tiny GLM-5.3 (glm_moe_dsa) checkpoint to OUT_DIR."""
    start = time.monotonic()
    click.echo(f"writing tiny GLM-5.3 checkpoint (seed {seed}) to {out_dir} ...", err=True)
    write_tiny_checkpoint(out_dir, seed=seed, reference_dir=reference_dir, exl3_all=exl3_all)
    extra = f" and reference {reference_dir}" if reference_dir else ""
    click.echo(f"wrote {out_dir}{extra} in {time.monotonic() - start:.1f} s", err=True)


if __name__ == "__main__":
    sys.exit(main())
