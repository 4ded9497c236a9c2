"""The TP layout plan and the per-rank slice reader, on real safetensors files the tests write."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from glm53.config import Glm53Config
from glm53.layout.kv import kv_bytes_per_rank, kv_token_bytes, positions_per_rank
from glm53.layout.plan import PlanError, SliceSpec, TensorLocation, plan_layout, split_units
from glm53.loading.slices import SliceReader, read_rank_tensors
from glm53.formats.safetensors_header import TensorInfo
from glm53.synthetic.checkpoints import glm53_tensor_specs, real_config, tiny_config, write_checkpoint, write_shard, TensorSpec


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_config(), n_shards=3, attn_exl3=False)


@pytest.fixture(scope="module")
def tiny_exl3_attn_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_exl3"), tiny_config(), n_shards=2, attn_exl3=True)


def _real_table(**cfg_overrides: object) -> tuple[dict[str, TensorInfo], Glm53Config]:
    cfg = Glm53Config.from_dict(real_config(**cfg_overrides))
    table, off = {}, 0
    for s in glm53_tensor_specs(cfg):
        table[s.name] = TensorInfo(s.name, s.dtype, s.shape, off, off + s.nbytes)
        off += s.nbytes
    return table, cfg


def test_split_units_rotation() -> None:
    assert split_units(64, 4) == ((0, 16), (16, 32), (32, 48), (48, 64))
    assert [b - a for a, b in split_units(64, 3)] == [22, 21, 21]
    assert [b - a for a, b in split_units(16, 3, 0)] == [6, 5, 5]
    assert [b - a for a, b in split_units(16, 3, 1)] == [5, 6, 5]
    assert [b - a for a, b in split_units(16, 3, 2)] == [5, 5, 6]
    assert [b - a for a, b in split_units(16, 5, 3)] == [3, 3, 3, 4, 3]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_slices_cover_each_tensor_once(tiny_dir: Path, ranks: int) -> None:
    plan = plan_layout(tiny_dir, ranks)
    per_rank = [plan.slices(r) for r in range(ranks)]
    replicated_bytes = 0
    for name, info in plan.tensors.items():
        specs = [s[name] for s in per_rank]
        if all(s is None for s in specs):
            replicated_bytes += info.nbytes
            continue
        dims = {s.dim for s in specs if s is not None}
        assert len(dims) == 1, name
        (dim,) = dims
        covered = [0] * info.shape[dim]
        for s in specs:
            assert s is not None, f"{name}: split on some ranks, whole on others"
            for k in range(s.start, s.stop):
                covered[k] += 1
        assert covered == [1] * info.shape[dim], name
    assert not plan.unclassified
    bpr = plan.bytes_per_rank()
    assert sum(bpr) == plan.total_bytes + (ranks - 1) * replicated_bytes


def test_rules_on_real_dims() -> None:
    table, cfg = _real_table(num_hidden_layers=9)  # real widths, fewer layers (6 MoE layers: 2 full rotations over 3)
    for ranks, heads in ((3, [22, 21, 21]), (4, [16] * 4)):
        plan = plan_layout(table, ranks, cfg)
        assert plan.summary()["heads_per_rank"] == heads
        for r in range(ranks):
            slices = plan.slices(r)
            feats = plan.features(r)
            h0 = sum(heads[:r])
            q = slices["model.layers.5.self_attn.q_b_proj.trellis"]  # [2048/16, 64*256/16, 16K]: out tiles
            assert q == SliceSpec(1, h0 * 256 // 16, (h0 + heads[r]) * 256 // 16)
            o = slices["model.layers.5.self_attn.o_proj.trellis"]  # by input: dim 0
            assert o == SliceSpec(0, h0 * 256 // 16, (h0 + heads[r]) * 256 // 16)
            assert slices["model.layers.5.self_attn.o_proj.svh"] is None
            assert slices["model.layers.5.self_attn.o_proj.suh"] == SliceSpec(0, h0 * 256, (h0 + heads[r]) * 256)
            assert feats["model.layers.5.self_attn.kv_b_proj"].own == (h0 * 448, (h0 + heads[r]) * 448)
            for name in ("model.layers.5.self_attn.q_a_proj.trellis", "model.layers.5.self_attn.kv_a_proj_with_mqa.trellis",
                         "model.layers.5.self_attn.indexer.wq_b.weight", "model.layers.5.mlp.gate.weight", "model.norm.weight"):
                assert slices[name] is None, name
            for layer in (3, 4, 5, 8):
                blocks = [b - a for a, b in split_units(16, ranks, layer % ranks)]
                b0 = sum(blocks[:r])
                gate = slices[f"model.layers.{layer}.mlp.experts.200.gate_proj.trellis"]  # [6144/16, 2048/16, 16K]
                assert gate == SliceSpec(1, b0 * 8, (b0 + blocks[r]) * 8)  # 8 tiles per 128 block
                assert slices[f"model.layers.{layer}.mlp.experts.200.gate_proj.svh"] == SliceSpec(0, b0 * 128, (b0 + blocks[r]) * 128)
                assert slices[f"model.layers.{layer}.mlp.experts.200.gate_proj.suh"] is None
                down = slices[f"model.layers.{layer}.mlp.shared_experts.down_proj.trellis"]  # [2048/16, 6144/16, 16K]
                assert down == SliceSpec(0, b0 * 8, (b0 + blocks[r]) * 8)
                assert slices[f"model.layers.{layer}.mlp.shared_experts.down_proj.suh"] == SliceSpec(0, b0 * 128, (b0 + blocks[r]) * 128)
                assert slices[f"model.layers.{layer}.mlp.shared_experts.down_proj.svh"] is None
            dense = slices["model.layers.0.mlp.up_proj.trellis"]  # 12288 = 96 blocks: 32 or 24 each
            assert dense == SliceSpec(1, r * (96 // ranks) * 8, (r + 1) * (96 // ranks) * 8)
            v = split_units(154880, ranks)[r]
            assert slices["lm_head.weight"] == SliceSpec(0, *v) and slices["model.embed_tokens.weight"] == SliceSpec(0, *v)
        if ranks == 3:
            plan3 = plan
    # over 3 ranks the rank with 6 expert blocks rotates with the layer index
    extra = [max(range(3), key=lambda r: (plan3.features(r)[f"model.layers.{i}.mlp.experts.0.up_proj"].own[1]
                                           - plan3.features(r)[f"model.layers.{i}.mlp.experts.0.up_proj"].own[0])) for i in range(3, 9)]
    assert extra == [0, 1, 2, 0, 1, 2]
    bpr = plan3.bytes_per_rank()
    assert max(bpr) - min(bpr) < 0.01 * max(bpr)  # rotation keeps ranks within 1 %


def test_exl3_head_split_widened_to_hadamard_blocks(tiny_exl3_attn_dir: Path) -> None:
    plan = plan_layout(tiny_exl3_attn_dir, 3)  # kv_b_proj: 4 heads x 64 rows over 3 ranks = 128/64/64 rows
    kvb = "model.layers.1.self_attn.kv_b_proj"
    feats = [plan.features(r)[kvb] for r in range(3)]
    assert [f.own for f in feats] == [(0, 128), (128, 192), (192, 256)]
    assert [f.read for f in feats] == [(0, 128), (128, 256), (128, 256)]
    assert plan.slices(1)[kvb + ".trellis"] == SliceSpec(1, 8, 16)
    assert kvb in plan.summary()["widened_exl3_modules"]


def test_read_rank_tensors_equals_safetensors_slices(tiny_dir: Path) -> None:
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())["weight_map"]
    for ranks in (3, 4):
        plan = plan_layout(tiny_dir, ranks)
        for r in range(ranks):
            reader = SliceReader()
            got = read_rank_tensors(tiny_dir, plan, r, reader=reader)
            slices = plan.slices(r)
            want_bytes = 0
            for name, tensor in got.items():
                with safe_open(str(tiny_dir / index[name]), "pt") as f:
                    spec = slices[name]
                    if spec is None:
                        ref = f.get_tensor(name)
                    else:
                        idx = tuple([slice(None)] * spec.dim + [slice(spec.start, spec.stop)])
                        ref = f.get_slice(name)[idx]
                assert tensor.dtype == ref.dtype and tensor.shape == ref.shape, name
                assert torch.equal(tensor.reshape(-1).view(torch.uint8), ref.contiguous().reshape(-1).view(torch.uint8)), name
                want_bytes += tensor.numel() * tensor.element_size()
            assert reader.bytes_read == want_bytes  # only the slices left the disk


def test_large_tensor_slice_reads_only_its_bytes(tmp_path: Path) -> None:
    """A 512 MiB (sparse) tensor: a rank's column slice reads 1/4 of it, with the right layout."""
    spec = TensorSpec("model.layers.0.mlp.down_proj.weight", "BF16", (8192, 32768))
    path = tmp_path / "big.safetensors"
    write_shard(path, [spec], sparse=True)
    marker = torch.arange(32768, dtype=torch.int16)  # row 7 gets real bytes; the rest is a hole (zeros)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    with open(path, "r+b") as f:
        f.seek(8 + n + 7 * 32768 * 2)
        f.write(marker.numpy().tobytes())
    info = TensorInfo(spec.name, "BF16", spec.shape, 0, spec.nbytes)
    reader = SliceReader()
    got = reader.read(info, TensorLocation(str(path), 8 + n), SliceSpec(1, 8192, 16384))
    assert got.shape == (8192, 8192)
    assert reader.bytes_read == 8192 * 8192 * 2 == spec.nbytes // 4
    assert torch.equal(got[7].view(torch.int16), torch.arange(8192, 16384, dtype=torch.int16))
    assert int(got[6].view(torch.int16).abs().sum()) == 0
    reader.close()


def test_plan_errors() -> None:
    table, cfg = _real_table(num_hidden_layers=5)
    with pytest.raises(PlanError, match="1..8"):
        plan_layout(table, 9, cfg)
    bad = dict(table)
    name = "model.layers.4.mlp.experts.3.up_proj.trellis"
    t = bad[name]
    bad[name] = TensorInfo(name, t.dtype, (t.shape[0], 100, t.shape[2]), t.begin, t.end)
    with pytest.raises(PlanError, match="model.layers.4.mlp.experts.3.up_proj"):
        plan_layout(bad, 4, cfg)


def test_kv_bytes_real_dims() -> None:
    cfg = Glm53Config.from_dict(real_config(indexer_types=["full" if i % 4 == 0 else "shared" for i in range(78)]))
    tok = kv_token_bytes(cfg, "bf16")
    assert (tok.latent, tok.indexer, tok.attention_layers, tok.indexer_layers) == (1152, 256, 78, 20)
    # fp8: 576 e4m3 values + one fp32 scale per row (what glm53.model.kv_state allocates)
    assert kv_token_bytes(cfg, "fp8").latent == 580 and kv_token_bytes(cfg, "fp8").indexer == 132
    T = 1 << 20
    assert kv_bytes_per_rank(cfg, T, 4) == [T // 4 * tok.per_token] * 4
    assert kv_bytes_per_rank(cfg, T, 4, dcp=False) == [T * tok.per_token] * 4
    for t in (0, 1, 2, 7, 1000):
        for r in (1, 3, 4):
            counts = positions_per_rank(t, r)
            assert counts == [sum(1 for p in range(t) if p % r == k) for k in range(r)]


def test_cli_prints_plan(tiny_dir: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "glm53.layout", str(tiny_dir), "--ranks", "3", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["heads_per_rank"] == [2, 1, 1] and len(doc["bytes_per_rank"]) == 3
    assert doc["bytes_per_rank"] == plan_layout(tiny_dir, 3).bytes_per_rank()
    out = subprocess.run([sys.executable, "-m", "glm53.layout", str(tiny_dir / "nope"), "--ranks", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "config.json" in out.stderr
