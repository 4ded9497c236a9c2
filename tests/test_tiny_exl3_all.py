"""The tiny checkpoint with every linear that may be EXL3 stored so (write_tiny_checkpoint(exl3_all=True)):
each such linear is an EXL3 group padded as exllamav3 pads it, the others stay plain, and the decoded
twin trims the padding, so transformers sees the config's shapes and the weights the default holds."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors import safe_open

import glm53.synthetic.tiny
from glm53.formats.checkpoint_rules import pad_features
from glm53.synthetic.tiny import linear_features
from tests.fixtures_tiny import tiny_dirs, tiny_exl3_all_dirs  # noqa: F401


def _shapes(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                out[name] = (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
    return out


def _tensor(folder: Path, name: str) -> torch.Tensor:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].get(name, "mtp.safetensors")
    with safe_open(str(folder / shard), "pt") as f:
        return f.get_tensor(name)


def test_every_linear_that_may_be_exl3_is_and_is_padded(tiny_exl3_all_dirs) -> None:  # noqa: F811
    shapes = _shapes(tiny_exl3_all_dirs.model)
    rules = linear_features(shapes)
    assert any(p.endswith("eh_proj") for p in rules) and any(p.endswith("indexer.wq_b") for p in rules)
    for prefix, rule in rules.items():
        if not rule.required and f"{prefix}.weight" not in shapes:
            continue  # MTP's own head: the tiny model has none
        if not rule.exl3:
            assert f"{prefix}.weight" in shapes and f"{prefix}.trellis" not in shapes, prefix
            continue
        assert f"{prefix}.weight" not in shapes, prefix
        pin, pout = rule.padded()
        trellis, dtype = shapes[f"{prefix}.trellis"]
        assert dtype == "I16" and trellis[:2] == (pin // 16, pout // 16), (prefix, trellis)
        assert shapes[f"{prefix}.suh"][0] == (pin,) and shapes[f"{prefix}.svh"][0] == (pout,)
    kv_a, kv_b = (rules[f"model.layers.0.self_attn.{m}"] for m in ("kv_a_proj_with_mqa", "kv_b_proj"))
    assert (kv_a.out_f, pad_features(kv_a.out_f)) == (80, 128) and (kv_b.in_f, pad_features(kv_b.in_f)) == (64, 128)


def test_the_decoded_twin_trims_the_padding(tiny_dirs, tiny_exl3_all_dirs) -> None:  # noqa: F811
    ref_all, ref = tiny_exl3_all_dirs.reference, tiny_dirs.reference
    shapes = {name: shape for name, (shape, _) in _shapes(ref).items()}
    assert {name: shape for name, (shape, _) in _shapes(ref_all).items()} == shapes  # the config's: what transformers loads
    for m in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):  # padded outputs, padded inputs, none
        for layer in (0, 4):
            name = f"model.layers.{layer}.self_attn.{m}.weight"
            decoded, plain = _tensor(ref_all, name), _tensor(ref, name)
            err = (decoded - plain).square().mean().sqrt() / plain.square().mean().sqrt()
            assert err < 0.5, (name, err)  # the test encoder at K = 4: 0.25-0.29; rows or columns misplaced: ~1.4


def test_cli_flag(tmp_path: Path, monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(glm53.synthetic.tiny, "write_tiny_checkpoint", lambda out, **kw: seen.update(kw))
    result = CliRunner().invoke(glm53.synthetic.tiny.main, [str(tmp_path / "t"), "--exl3-all"])
    assert result.exit_code == 0, result.output
    assert seen["exl3_all"] is True
