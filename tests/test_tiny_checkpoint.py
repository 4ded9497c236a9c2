"""The tiny GLM-5.3 checkpoint: deterministic, every feature present, parsed by glm53.config, and its
decoded twin loads in transformers' GlmMoeDsaForCausalLM with no missing or unexpected weights."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from glm53.config import Glm53Config
from glm53.exl3.decode import dequantize_exact
from glm53.exl3.format import read_group
from glm53.synthetic.tiny import MTP_LAYER, N_EXPERTS, PROJECTIONS, TINY_CONFIG, expert_quant, write_tiny_checkpoint
from glm53.synthetic.tiny_tokenizer import SPECIAL_TOKENS, special_id


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    out = write_tiny_checkpoint(root / "model", seed=0, reference_dir=root / "reference")
    return out, root / "reference"


def load_all(d: Path) -> dict[str, torch.Tensor]:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(d / f)))
    assert set(tensors) == set(index["weight_map"])
    return tensors


@pytest.fixture(scope="module")
def tensors(dirs) -> dict[str, torch.Tensor]:
    return load_all(dirs[0])


def test_other_seed_other_weights_same_tokenizer(dirs, tmp_path) -> None:
    other = write_tiny_checkpoint(tmp_path / "other", seed=1)
    shard = "model-00002-of-00004.safetensors"
    assert (dirs[0] / shard).read_bytes() != (other / shard).read_bytes()
    assert (dirs[0] / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_config_parses_and_has_every_feature(dirs) -> None:
    cfg = Glm53Config.from_dir(dirs[0])
    assert {"full", "shared"} <= set(cfg.indexer_types) and cfg.indexer_types[0] == "full"
    assert cfg.index_topk <= 64
    assert cfg.mlp_layer_types.count("dense") >= 1 and cfg.mlp_layer_types.count("sparse") >= 3
    assert cfg.n_shared_experts == 1 and cfg.num_nextn_predict_layers == 1
    assert cfg.max_position_embeddings >= 16384
    assert cfg.hidden_size % 128 == 0
    # every part splits over 2, 3 and 4 ranks in 128-column blocks
    assert cfg.moe_intermediate_size % 128 == 0 and cfg.moe_intermediate_size // 128 >= 4
    assert cfg.intermediate_size % 128 == 0 and cfg.intermediate_size // 128 >= 4
    assert cfg.num_attention_heads >= 4
    assert 2000 <= cfg.vocab_size <= 4096
    assert cfg.eos_token_ids == (special_id("<|endoftext|>"), special_id("<|user|>"), special_id("<|observation|>"))
    assert cfg.quantization_config["quant_method"] == "exl3"
    gen = json.loads((dirs[0] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == list(cfg.eos_token_ids)


def test_shards_and_index(dirs, tensors) -> None:
    index = json.loads((dirs[0] / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) == 4 and all((dirs[0] / f).is_file() for f in files)
    for f in files:
        with safe_open(str(dirs[0] / f), "pt") as sf:
            assert all(index["weight_map"][k] == f for k in sf.keys())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert not any(p.name.startswith(".") for p in dirs[0].parent.iterdir())  # no staging left behind


def test_experts_are_exl3_at_mixed_widths(tensors) -> None:
    cfg = Glm53Config.from_dict(TINY_CONFIG)
    moe_layers = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "sparse"] + [MTP_LAYER]
    widths, codebooks, per_expert_mixed = set(), set(), 0
    for layer in moe_layers:
        for e in range(N_EXPERTS):
            ks = set()
            for j, proj in enumerate(PROJECTIONS):
                prefix = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                g = read_group(tensors, prefix)
                assert (g.bits, g.codebook) == expert_quant(layer, e, j)
                assert f"{prefix}.weight" not in tensors
                widths.add(g.bits)
                codebooks.add(g.codebook)
                ks.add(g.bits)
            per_expert_mixed += len(ks) > 1
    assert {2.0, 3.0, 4.0} <= widths and {2.5, 3.5} <= widths
    assert codebooks == {"3inst", "mcg", "mul1"}
    assert per_expert_mixed > 0  # one expert's projections differ in width


def test_plain_tensors_are_bf16_and_mtp_is_deepseek_style(tensors) -> None:
    for name, t in tensors.items():
        if ".experts." in name and ".shared_experts." not in name:
            continue
        want = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        assert t.dtype == want, name
    m = f"model.layers.{MTP_LAYER}"
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_a_proj_with_mqa.weight", "mlp.shared_experts.down_proj.weight", "mlp.gate.weight"):
        assert f"{m}.{part}" in tensors, part
    assert tensors[f"{m}.eh_proj.weight"].shape == (256, 512)
    # shared indexer layers carry no indexer weights; full ones do
    assert "model.layers.0.self_attn.indexer.wk.weight" in tensors
    assert not any(k.startswith("model.layers.1.self_attn.indexer.") for k in tensors)


def test_quantization_config_lists_per_module_bits(dirs, tensors) -> None:
    q = json.loads((dirs[0] / "quantization_config.json").read_text())
    storage = q["tensor_storage"]
    total_w = total_bits = 0
    for name in tensors:
        if name.endswith(".trellis"):
            module = name[: -len(".trellis")]
            g = read_group(tensors, module)
            assert storage[module]["quant_format"] == "exl3"
            assert storage[module]["bits_per_weight"] == g.bits
            assert (g.codebook == "mcg") == ("mcg_multiplier" in storage[module])
            total_w += g.in_features * g.out_features
            total_bits += g.in_features * g.out_features * g.bits
    assert "model.embed_tokens" in storage and "quant_format" not in storage["model.embed_tokens"]
    cfg = json.loads((dirs[0] / "config.json").read_text())
    assert cfg["quantization_config"]["bits"] == pytest.approx(total_bits / total_w, abs=1e-4)


def test_tokenizer_and_chat_template(dirs) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(dirs[0]))
    for t in SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(t) == special_id(t)
    text = "Hello, world! The weather is sunny."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True, tokenize=False,
    )
    # GLM-5.3's form: the reasoning effort line, no separator after a role, the reply opens in <think>
    assert prompt == "[gMASK]<sop><|system|>Reasoning Effort: Max<|system|>Be brief.<|user|>hi<|assistant|><think>"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [special_id("[gMASK]"), special_id("<sop>")]
    assert ids[-2:] == [special_id("<|assistant|>"), special_id("<think>")]
    # the thinking and tool markup are single tokens that a decode skipping special tokens keeps, as in GLM
    markup = "<think>x</think><tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>"
    markup_ids = tok.encode(markup, add_special_tokens=False)
    assert special_id("<arg_value>") in markup_ids and tok.decode(markup_ids, skip_special_tokens=True) == markup


def test_reference_twin_loads_in_transformers_and_runs(dirs, tensors) -> None:
    from transformers import GlmMoeDsaForCausalLM

    ref = dirs[1]
    model, info = GlmMoeDsaForCausalLM.from_pretrained(str(ref), output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    # the experts are the format's exact matrices (dequantize_exact, rounded once to fp32), fused as gate|up
    experts = model.model.layers[2].mlp.experts
    for e in (0, N_EXPERTS - 1):
        p = f"model.layers.2.mlp.experts.{e}"
        gate = dequantize_exact(read_group(tensors, f"{p}.gate_proj")).float().t()
        up = dequantize_exact(read_group(tensors, f"{p}.up_proj")).float().t()
        down = dequantize_exact(read_group(tensors, f"{p}.down_proj")).float().t()
        assert torch.equal(experts.gate_up_proj[e], torch.cat([gate, up], 0))
        assert torch.equal(experts.down_proj[e], down)
    assert torch.equal(model.model.layers[0].self_attn.q_a_proj.weight, tensors["model.layers.0.self_attn.q_a_proj.weight"].float())
    # MTP tensors sit beside the twin, decoded too
    mtp = load_file(str(ref / "mtp.safetensors"))
    assert f"model.layers.{MTP_LAYER}.mlp.experts.0.gate_proj.weight" in mtp and f"model.layers.{MTP_LAYER}.eh_proj.weight" in mtp
    ids = torch.arange(3, 3 + 80).unsqueeze(0)  # longer than index_topk (32)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 80, 2048) and torch.isfinite(logits).all()
    assert logits.std() > 0.1


def test_cli_writes_the_same_bytes_and_refuses_a_non_empty_folder(dirs, tmp_path) -> None:
    """Same seed, same bytes: a second writer in another process reproduces every file."""
    out = tmp_path / "cli"
    run = subprocess.run([sys.executable, "-m", "glm53.synthetic.tiny", str(out), "--seed", "0"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stderr
    files = sorted(p.name for p in dirs[0].iterdir())
    assert files == sorted(p.name for p in out.iterdir())
    for name in files:
        assert (dirs[0] / name).read_bytes() == (out / name).read_bytes(), name
    again = subprocess.run([sys.executable, "-m", "glm53.synthetic.tiny", str(out)], capture_output=True, text=True)
    assert again.returncode == 2 and "not an empty folder" in again.stderr
    # a bad --reference is refused before anything is written
    fresh = tmp_path / "fresh"
    bad_ref = subprocess.run([sys.executable, "-m", "glm53.synthetic.tiny", str(fresh), "--reference", str(out)],
                             capture_output=True, text=True)
    assert bad_ref.returncode == 2 and "not an empty folder" in bad_ref.stderr and not fresh.exists()
    assert not any(".partial" in p.name for p in tmp_path.iterdir())


def test_passes_the_weights_verifier(dirs) -> None:
    from glm53.checkpoints.verify import verify_checkpoint

    result = verify_checkpoint(dirs[0])
    assert result.config is not None and result.findings == [], result.findings
