"""Checkpoints the benches run: the tiny test checkpoint, random bf16 weights at GLM-5.3's layer
dimensions (dense, MoE, or GLM-5.3's mix), and an engine's model run deeper than its checkpoint.

    python -m bench.lib.checkpoints DIR --layers 4 --vocab 32768 [--moe-experts 256 --dense-layers 1] [--tokenizer]

writes DIR/real_dims (bench/run_h200.sh and bench/ab_h200.sh share one checkpoint between runs);
--tokenizer adds a tokenizer and chat template, for a lane that serves it (add_tokenizer).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

from bench.lib.log import log
from glm53.config import Glm53Config
from glm53.runtime.engine import Glm53Engine
from glm53.model.transformer import Glm53Model


def tiny_checkpoint(root: Path) -> Path:
    from glm53.synthetic.tiny import write_tiny_checkpoint

    log("writing the tiny checkpoint (EXL3 encode; a minute or two on a CPU) ...")
    return write_tiny_checkpoint(root / "tiny")


EXPERTS_PER_SHARD = 32  # a real-width expert's three projections are 75 MB of bf16


def real_dims_checkpoint(root: Path, layers: int, vocab: int, moe_experts: int = 0, dense_layers: int = 0) -> Path:
    """GLM-5.3 layer dimensions, plain bf16 weights: all-dense layers, or with `moe_experts` > 0
    MoE layers as GLM-5.3's (top 8 of that many routed experts of width 2048, one shared expert;
    256 is GLM-5.3's: 19 GB a layer) after the first `dense_layers` dense ones."""
    from safetensors.torch import save_file

    from glm53.synthetic.tiny import TINY_CONFIG, _layer_plain, _linear, _norm, _randn

    real = Glm53Config()  # the defaults are GLM-5.3's published dimensions
    cfg = {**TINY_CONFIG, **{k: getattr(real, k) for k in (
        "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads", "q_lora_rank",
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_topk", "index_head_dim",
        "index_n_heads", "rms_norm_eps", "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group")}}
    moe = moe_experts > 0
    if not 0 <= dense_layers < layers or (dense_layers and not moe):
        raise ValueError(f"dense_layers {dense_layers}: needs MoE layers after it, below the {layers} layers")
    n_dense = dense_layers if moe else layers
    cfg.update(num_hidden_layers=layers, num_key_value_heads=cfg["num_attention_heads"], vocab_size=vocab,
               first_k_dense_replace=n_dense, mlp_layer_types=["dense"] * n_dense + ["sparse"] * (layers - n_dense),
               indexer_types=[("full" if i % 2 == 0 else "shared") for i in range(layers)],
               num_nextn_predict_layers=0, max_position_embeddings=1 << 20, bos_token_id=0,
               eos_token_id=[1], head_dim=cfg["qk_rope_head_dim"])
    if moe:
        cfg.update(n_routed_experts=moe_experts, num_experts_per_tok=min(real.num_experts_per_tok, moe_experts))
    out = root / "real_dims"
    out.mkdir()
    h = cfg["hidden_size"]
    kind = f"{n_dense} dense then MoE ({moe_experts} routed experts)" if moe else "dense"
    log(f"writing a {layers}-layer checkpoint at GLM-5.3 layer dimensions (hidden {h}, {kind}) ...")
    files: dict[str, str] = {}

    def save(tensors: dict[str, torch.Tensor], name: str) -> None:
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(out / name),
                  metadata={"format": "pt"})
        files.update({k: name for k in tensors})

    head = {"model.embed_tokens.weight": _randn("model.embed_tokens", (vocab, h), 0, 1.0),
            "model.norm.weight": _norm("model.norm", h, 0), "lm_head.weight": _linear("lm_head", vocab, h, 0)}
    save(head, "model-head.safetensors")
    for layer in range(layers):
        save(_layer_plain(layer, cfg, 0), f"model-layer{layer:03d}.safetensors")
        for first in range(0, moe_experts if layer >= n_dense else 0, EXPERTS_PER_SHARD):
            save(_expert_weights(layer, range(first, min(first + EXPERTS_PER_SHARD, moe_experts)), cfg),
                 f"model-layer{layer:03d}-experts{first:03d}.safetensors")
        log(f"  layer {layer + 1}/{layers}")
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def add_tokenizer(model_dir: Path) -> None:
    """The tiny checkpoint's tokenizer and chat template (glm53.synthetic.tiny_tokenizer) in `model_dir`, so a
    lane can serve it: the ids from the tiny vocabulary's end up to config.json's vocab_size are reserved
    tokens (<|reserved_N|>, as the tiny tokenizer pads its own), so every id the model can emit decodes to
    text; config.json's bos, eos and pad ids become the tokenizer's."""
    from tokenizers import Tokenizer

    from glm53.synthetic.tiny_tokenizer import write_tokenizer

    config_file = model_dir / "config.json"
    cfg = json.loads(config_file.read_text())
    vocab = int(cfg["vocab_size"])
    ids = write_tokenizer(model_dir)
    tok_file = model_dir / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_file))
    have = tok.get_vocab_size(with_added_tokens=True)
    if have > vocab:
        raise ValueError(f"the tiny tokenizer has {have} ids, more than the checkpoint's vocab_size {vocab}")
    tok.add_tokens([f"<|reserved_{i}|>" for i in range(have, vocab)])
    if tok.get_vocab_size(with_added_tokens=True) != vocab:
        raise AssertionError(f"the padded tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, not {vocab}")
    tok_file.write_text(tok.to_str(pretty=True), encoding="utf-8")
    config_file.write_text(json.dumps({**cfg, **ids}, indent=1))


def _expert_weights(layer: int, experts: range, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Routed experts of one layer, [out, in] with std 1/sqrt(in) (glm53.synthetic.tiny's init), drawn on the
    GPU where there is one: GLM-5.3's 256 experts a layer are 9.7 G values, minutes for the CPU."""
    h, width = cfg["hidden_size"], cfg["moe_intermediate_size"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(1009 * layer + experts.start)
    out = {}
    for proj, (out_f, in_f) in (("gate_proj", (width, h)), ("up_proj", (width, h)), ("down_proj", (h, width))):
        block = (torch.randn((len(experts), out_f, in_f), generator=gen, device=device) * in_f ** -0.5)
        block = block.to(torch.bfloat16).cpu()
        for i, e in enumerate(experts):  # each its own storage: safetensors refuses shared ones
            out[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = block[i].clone()
    return out


def deepen(engine: Glm53Engine, depth: int | None) -> None:
    """Run the engine's model at `depth` layers (None: as loaded): the checkpoint's layers repeated
    in order, each repeat its own KV cache layer but the same weight tensors. GLM-5.3's 78 layers at
    its layer dimensions do not fit this machine's disk as a checkpoint (~67 GB of bf16); shared
    tensors cost the same time per layer, since a layer's weights (~0.86 GB) are far larger than L2
    and are read again from memory by every layer that uses them. (Layer 0 runs its own indexer,
    the config guarantees it, so every repeat's 'shared' layers follow a 'full' one.)
    A checkpoint with both dense and MoE layers gets GLM-5.3's mix: its dense layers repeated over
    the first GLM-5.3's-count (3) layers, its MoE layers over the rest (75 of 78)."""
    w, cfg = engine.model.w, engine.cfg
    n = len(w.layers)
    if depth is not None and depth < n:
        raise ValueError(f"--depth {depth} is below the checkpoint's {n} layers")
    if depth is None or depth == n:
        return
    pick = layer_pick(list(cfg.mlp_layer_types), depth)
    layers = [dataclasses.replace(w.layers[j], index=i) for i, j in enumerate(pick)]
    engine.cfg = dataclasses.replace(cfg, num_hidden_layers=depth,
                                     indexer_types=tuple(cfg.indexer_types[j] for j in pick),
                                     mlp_layer_types=tuple(cfg.mlp_layer_types[j] for j in pick))
    engine.model = Glm53Model(engine.cfg, dataclasses.replace(w, layers=layers), engine.plan,
                              engine.model.dtype, engine.device)
    engine.graphs = engine._window_graphs("1" if engine.graphs is not None else "0")


def layer_pick(mlp_layer_types: list[str], depth: int) -> list[int]:
    """Which checkpoint layer runs at each of `depth` positions: all of one kind cycle in order;
    dense layers followed by MoE ones take GLM-5.3's first 3 positions and the MoE ones the rest."""
    dense = [i for i, t in enumerate(mlp_layer_types) if t == "dense"]
    sparse = [i for i, t in enumerate(mlp_layer_types) if t == "sparse"]
    if not dense or not sparse:
        return [i % len(mlp_layer_types) for i in range(depth)]
    if dense != list(range(len(dense))):
        raise ValueError("the checkpoint's dense layers must come before its MoE layers (first_k_dense_replace)")
    n_dense = min(Glm53Config().first_k_dense_replace, depth - 1)
    return [dense[i % len(dense)] if i < n_dense else sparse[(i - n_dense) % len(sparse)] for i in range(depth)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write a checkpoint at GLM-5.3 layer dimensions into DIR/real_dims")
    p.add_argument("root", type=Path, help="an existing empty folder")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--moe-experts", type=int, default=0, help="routed experts of the MoE layers (0: all dense)")
    p.add_argument("--dense-layers", type=int, default=0, help="with --moe-experts: the first this many dense")
    p.add_argument("--tokenizer", action="store_true",
                   help="add a tokenizer and chat template (the tiny one, padded to --vocab) for a serving lane")
    args = p.parse_args(argv)
    try:
        out = real_dims_checkpoint(args.root, args.layers, args.vocab, args.moe_experts, args.dense_layers)
        if args.tokenizer:
            add_tokenizer(out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
