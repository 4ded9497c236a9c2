"""The benches' depth (bench.lib.checkpoints.deepen): a checkpoint's layers repeated with shared weights
run exactly as a checkpoint that holds those layers, written here by renaming the tiny checkpoint's
tensors; and GLM-5.3's layer mix (3 dense then MoE) from a mixed checkpoint. Every 78-layer number
in bench/results rests on this."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.lib.checkpoints import deepen, layer_pick
from tests.fixtures_tiny import TINY_CHUNK, tiny_dirs  # noqa: F401

LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def test_layer_pick_gives_glm53s_mix() -> None:
    pick = layer_pick(["dense", "sparse", "sparse"], 78)
    assert pick[:5] == [0, 0, 0, 1, 2] and pick[-2:] == [2, 1]
    assert pick.count(0) == 3 and len(pick) == 78  # GLM-5.3: 3 dense, 75 MoE
    assert layer_pick(["dense"] * 4, 6) == [0, 1, 2, 3, 0, 1]  # one kind: the checkpoint in order
    assert layer_pick(["dense", "sparse"], 3) == [0, 0, 1]  # always some MoE after the dense ones
    with pytest.raises(ValueError, match="dense layers must come before"):
        layer_pick(["sparse", "dense"], 4)


def _write_deeper(src: Path, dst: Path, pick: list[int]) -> None:
    """`src` with layer pick[i] at position i (tensors copied, not shared) and the MTP layer moved
    after the last: the checkpoint deepen() stands for."""
    cfg = json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = LAYER.fullmatch(name)
        if m is None:
            out[name] = t
        elif int(m[1]) >= n:  # MTP
            out[f"model.layers.{int(m[1]) - n + len(pick)}.{m[2]}"] = t
        else:
            out.update({f"model.layers.{i}.{m[2]}": t.clone() for i, j in enumerate(pick) if j == int(m[1])})
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    cfg.update(num_hidden_layers=len(pick), mlp_layer_types=[cfg["mlp_layer_types"][j] for j in pick],
               indexer_types=[cfg["indexer_types"][j] for j in pick],
               first_k_dense_replace=sum(cfg["mlp_layer_types"][j] == "dense" for j in pick))
    (dst / "config.json").write_text(json.dumps(cfg))


def test_deepened_engine_is_the_deeper_checkpoint(tiny_dirs, tmp_path: Path) -> None:  # noqa: F811
    from glm53.runtime.engine import Glm53Engine

    def engine(model: Path) -> Glm53Engine:
        return Glm53Engine(model, device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=TINY_CHUNK,
                           cache_block=TINY_CHUNK)

    depth = 7
    deep = engine(tiny_dirs.model)
    pick = layer_pick(list(deep.cfg.mlp_layer_types), depth)
    assert pick == [0, 0, 0, 1, 2, 3, 1]  # the tiny checkpoint: one dense, three MoE layers
    deepen(deep, depth)
    assert deep.cfg.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 4
    _write_deeper(tiny_dirs.model, tmp_path / "deeper", pick)
    real = engine(tmp_path / "deeper")
    assert real.cfg.mlp_layer_types == deep.cfg.mlp_layer_types
    assert real.cfg.indexer_types == deep.cfg.indexer_types

    prompt = [(37 * i + 11) % deep.vocab_size for i in range(3 * TINY_CHUNK + 5)]  # several prefill pieces
    replies = [e.generate(prompt, 6, {"ignore_eos": True}) for e in (deep, real)]
    assert replies[0] == replies[1]
    a, b = deep.state, real.state
    assert a.length == b.length == len(prompt) + 5 and a.indexed_layers == b.indexed_layers
    for kind in ("latent", "index_keys"):  # every layer's KV rows, bit for bit
        assert torch.equal(a.stacks[kind][:, :a.length], b.stacks[kind][:, :b.length]), kind
