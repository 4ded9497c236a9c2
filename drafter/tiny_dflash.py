"""Writes a tiny DFlash2 drafter (config.json + model.safetensors, random weights) for tests.

The layout and names follow what `drafter.sources.dflash2.Dflash2Model.load` reads (the real
checkpoint's naming). Weights are random and seeded: its drafts exercise the machinery and mean
nothing about acceptance. Files are written to a temporary name and renamed into place.

    python -m drafter.tiny_dflash OUT_DIR --vocab-size 96 --hidden-size 32 --target-layers 0,1
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
import torch
from safetensors.torch import save_file

from .sources.dflash2 import Dflash2Config


def tiny_dflash2_config(*, vocab_size: int, hidden_size: int, target_layer_ids: list[int],
                        mask_token_id: int | None = None, block_size: int = 8, num_hidden_layers: int = 1,
                        num_attention_heads: int = 4, num_key_value_heads: int = 2,
                        selector_rank: int = 8, selector_top_k: int = 8, conv_group_size: int = 8) -> dict:
    head_dim = hidden_size // num_attention_heads
    return {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "dflash2",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "intermediate_size": 2 * hidden_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "block_size": block_size,
        "layer_types": ["full_attention"] * num_hidden_layers,
        "dflash_config": {
            "mask_token_id": vocab_size - 1 if mask_token_id is None else mask_token_id,
            "target_layer_ids": list(target_layer_ids),
            "conv_kernel_size": 2,
            "conv_group_size": conv_group_size,
            "selector_rank": selector_rank,
            "selector_top_k": selector_top_k,
        },
    }


def write_tiny_dflash2(out_dir: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                       **config_args) -> Path:
    """Write a tiny DFlash2 drafter into out_dir; returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_dflash2_config(**config_args)
    cfg = Dflash2Config.from_dict(raw, source="tiny_dflash2_config")
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in sorted(cfg.expected_shapes().items()):
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("base_kernel"):
            t = 0.5 * torch.randn(shape, generator=g)
        else:
            fan_in = shape[-1]
            t = torch.randn(shape, generator=g) / fan_in ** 0.5
        tensors[name] = t.to(dtype).contiguous()
    _atomic_write(out / "config.json", lambda p: p.write_text(json.dumps(raw, indent=2) + "\n"))
    _atomic_write(out / "model.safetensors",
                  lambda p: save_file(tensors, str(p), metadata={"format": "pt", "note": "tiny random DFlash2 for tests"}))
    return out


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--vocab-size", type=int, required=True, help="the target's vocabulary size")
@click.option("--hidden-size", type=int, required=True, help="the target's hidden size")
@click.option("--target-layers", required=True, help="comma-separated target layer ids to condition on")
@click.option("--block-size", type=int, default=8, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def main(out_dir: str, vocab_size: int, hidden_size: int, target_layers: str, block_size: int, seed: int) -> None:
    try:
        layers = [int(x) for x in target_layers.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"--target-layers must be comma-separated integers, got {target_layers!r}")
    try:
        write_tiny_dflash2(out_dir, seed=seed, vocab_size=vocab_size, hidden_size=hidden_size,
                           target_layer_ids=layers, block_size=block_size)
    except ValueError as e:
        click.echo(f"tiny_dflash: {e}", err=True)
        sys.exit(2)
    click.echo(f"wrote tiny DFlash2 drafter to {out_dir}")


if __name__ == "__main__":
    main()
