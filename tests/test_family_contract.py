"""TensorFold's family contract, as glm53 implements it (what TensorFold's CLI and server call)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import glm53
from glm53.config import ConfigError
from glm53.runtime.errors import EngineError
from glm53.loading.loader import CheckpointError
from tests.fixtures_tiny import fresh_engine_state, tiny_dirs, tiny_engine  # noqa: F401


def _copy(src: Path, dst: Path) -> Path:
    """A checkpoint folder whose shards link to the original (only edited files are rewritten)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        else:
            shutil.copy(f, dst / f.name)
    return dst


def _edit_json(path: Path, edit) -> None:  # noqa: ANN001
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_package_exports_the_contract() -> None:
    assert glm53.MODEL_TYPES == ("glm_moe_dsa",)
    assert callable(glm53.check) and callable(glm53.cuda_engine)


def test_check_accepts_the_tiny_checkpoint(tiny_dirs) -> None:  # noqa: F811
    assert glm53.check(tiny_dirs.model) is None


def test_check_refuses_wrong_model_type(tiny_dirs, tmp_path) -> None:  # noqa: F811
    d = _copy(tiny_dirs.model, tmp_path / "m")
    _edit_json(d / "config.json", lambda c: c.update(model_type="glm5_next"))
    with pytest.raises(ConfigError, match=r"config\.json.*model_type.*glm5_next"):
        glm53.check(d)


def test_check_refuses_missing_tensor(tiny_dirs, tmp_path) -> None:  # noqa: F811
    d = _copy(tiny_dirs.model, tmp_path / "m")
    name = "model.layers.2.self_attn.indexer.wk.weight"
    _edit_json(d / "model.safetensors.index.json", lambda ix: ix["weight_map"].pop(name))
    with pytest.raises(CheckpointError, match=rf"{name} is missing"):
        glm53.check(d)


def test_check_refuses_unservable_exl3_width(tiny_dirs, tmp_path) -> None:  # noqa: F811
    d = _copy(tiny_dirs.model, tmp_path / "m")
    name = "model.layers.1.mlp.experts.3.up_proj.trellis"
    cfg = json.loads((d / "config.json").read_text())
    shape = (cfg["hidden_size"] // 16, cfg["moe_intermediate_size"] // 16, 16 * 5)  # K = 5 bits
    save_file({name: torch.zeros(shape, dtype=torch.int16)}, str(d / "patched.safetensors"))
    _edit_json(d / "model.safetensors.index.json", lambda ix: ix["weight_map"].update({name: "patched.safetensors"}))
    with pytest.raises(CheckpointError, match=r"patched\.safetensors.*experts\.3\.up_proj\.trellis.*K = 5"):
        glm53.check(d)


def test_check_refuses_shape_disagreeing_with_config(tiny_dirs, tmp_path) -> None:  # noqa: F811
    d = _copy(tiny_dirs.model, tmp_path / "m")
    _edit_json(d / "config.json", lambda c: c.update(kv_lora_rank=96))
    with pytest.raises(CheckpointError, match=r"kv_a_proj_with_mqa\.weight has shape .*config\.json implies"):
        glm53.check(d)


def test_check_refuses_missing_shard(tiny_dirs, tmp_path) -> None:  # noqa: F811
    d = _copy(tiny_dirs.model, tmp_path / "m")
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"names shard {shard.name}"):
        glm53.check(d)


def test_generate_streams_and_stops_on_false(tiny_engine) -> None:  # noqa: F811
    prompt = list(range(10, 60))
    seen: list[list[int]] = []
    with fresh_engine_state(tiny_engine):
        full = tiny_engine.generate(prompt, 8, {"ignore_eos": True}, lambda new: seen.append(new))
        assert [t for batch in seen for t in batch] == full and len(full) == 8
        stats = tiny_engine.last_stats
        assert stats["prompt_tokens"] == 50 and stats["completion_tokens"] == 8 and stats["finish_reason"] == "length"
        assert "cached_tokens" in stats

        calls: list[list[int]] = []

        def hang_up(new: list[int]) -> bool:
            calls.append(new)
            return len(calls) < 3

        cut = tiny_engine.generate(prompt, 8, {"ignore_eos": True}, hang_up)
        assert cut == full[:3] and len(calls) == 3
        assert tiny_engine.last_stats["finish_reason"] == "cancelled"
        assert tiny_engine.last_stats["completion_tokens"] == 3


def test_eos_ends_the_reply_unless_ignored(tiny_engine) -> None:  # noqa: F811
    prompt = list(range(100, 140))
    with fresh_engine_state(tiny_engine, reuse_live=False):
        free = tiny_engine.generate(prompt, 10, {"ignore_eos": True})
        stop_token = free[3]
        first = free.index(stop_token)
        tiny_engine.eos = [stop_token]
        try:
            stopped = tiny_engine.generate(prompt, 10, {})
            assert stopped == free[:first + 1]  # the eos token is part of the reply (TensorFold's convention)
            assert tiny_engine.last_stats["finish_reason"] == "stop"
            assert tiny_engine.generate(prompt, 10, {"ignore_eos": True}) == free
        finally:
            tiny_engine.eos = list(tiny_engine.cfg.eos_token_ids)


def test_bad_requests_are_refused_with_the_field_named(tiny_engine) -> None:  # noqa: F811
    with pytest.raises(EngineError, match="prompt"):
        tiny_engine.generate([], 4)
    with pytest.raises(EngineError, match=r"prompt token 999999"):
        tiny_engine.generate([1, 999999], 4)
    with pytest.raises(EngineError, match="max_tokens"):
        tiny_engine.generate([1, 2], -1)
    with pytest.raises(ValueError, match="top_p"):
        tiny_engine.generate([1, 2], 4, {"temperature": 0.7, "top_p": 1.5})
    assert tiny_engine.generate([1, 2], 0) == []


def test_follow_returns_at_once_on_one_rank(tiny_engine) -> None:  # noqa: F811
    assert tiny_engine.follow() is None
    assert isinstance(tiny_engine.eos, list) and all(isinstance(t, int) for t in tiny_engine.eos)


def test_cuda_engine_runs_on_cpu_and_refuses_unknown_options(tiny_dirs) -> None:  # noqa: F811
    with pytest.raises(EngineError, match="unknown engine option.*colour"):
        glm53.cuda_engine(tiny_dirs.reference, device="cpu", colour="blue")
    with pytest.raises(EngineError, match="ranks run 0..tp-1"):
        glm53.cuda_engine(tiny_dirs.reference, device="cpu", tp=2, rank=2)
    engine = glm53.cuda_engine(tiny_dirs.reference, device="cpu", drafter=None, tp=1, rank=0,
                               master="127.0.0.1", master_port=29551, no_drafts=True, mtp_drafts=None)
    assert engine.device.type == "cpu" and engine.dtype_name == "fp32"
    assert len(engine.generate([5, 6, 7], 3, None)) == 3


RANK_SCRIPT = """
import json, sys
import glm53
model_dir, tp, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
engine = glm53.cuda_engine(model_dir, tp=tp, rank=rank, master="127.0.0.1", master_port=port,
                           device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=32)
if rank > 0:          # what the patched CLI does for every rank above 0 (patches/0001)
    engine.follow()
else:
    print(json.dumps(engine.generate(list(range(3, 50)), 6, {"ignore_eos": True})), flush=True)
    engine.close()
"""


@pytest.mark.slow
def test_cli_rank_dispatch_tp3_follows_rank_zero_and_matches_one_rank(tiny_dirs, tmp_path) -> None:  # noqa: F811
    """patches/0001's dispatch, run for real: tp 3, ranks 1 and 2 enter follow(), rank 0 serves;
    the reply equals one rank's greedy reply."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(tiny_dirs.reference), "3", str(r), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(3)]
    try:
        outs = [p.communicate(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}: {err[-2000:]}"
    reply = json.loads(outs[0][0].strip().splitlines()[-1])
    one = glm53.cuda_engine(tiny_dirs.reference, device="cpu", dtype="fp32", kv_dtype="fp32", prefill_chunk=32)
    assert reply == one.generate(list(range(3, 50)), 6, {"ignore_eos": True})


PATCHES = Path(__file__).resolve().parents[1] / "patches"


def _added_lines(patch: Path, file: str) -> list[str]:
    """The '+' lines of one file's hunks in a format-patch file."""
    lines, current = [], None
    for line in patch.read_text(encoding="utf-8").splitlines():
        if line.startswith("+++ "):
            current = line[len("+++ b/"):]
        elif current == file and line.startswith("+") and not line.startswith("+++"):
            lines.append(line[1:])
    return lines


def test_patch_0001_lifts_tp_to_four_and_sends_ranks_above_zero_to_follow() -> None:
    import ast

    patch = next(PATCHES.glob("0001-*.patch"))
    args = "\n".join(_added_lines(patch, "src/tensorfold/cli_args.py"))
    assert 'choices=(1, 2, 3, 4)' in args and 'choices=(0, 1, 2, 3)' in args
    text = patch.read_text(encoding="utf-8")
    follow = text.index("+    if args.rank > 0:")
    assert " engine.follow()" in text[follow:follow + 400]  # the branch every rank above 0 takes
    checks = "\n".join(_added_lines(patch, "src/tensorfold/cli.py")[:4])
    ast.parse("def f(args):\n" + checks + "\n        pass\n")  # the added guard lines are valid Python


def test_patch_0002_family_file_exposes_the_kit_contract(tmp_path) -> None:
    """Write the file 0002 adds into a stand-in families folder and import it against the installed kit."""
    import importlib.util

    patch = next(PATCHES.glob("0002-*.patch"))
    source = "\n".join(_added_lines(patch, "src/tensorfold/families/glm53_kit/__init__.py")) + "\n"
    target = tmp_path / "glm53_kit" / "__init__.py"
    target.parent.mkdir()
    target.write_text(source)
    spec = importlib.util.spec_from_file_location("glm53_kit", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.MODEL_TYPES == glm53.MODEL_TYPES == ("glm_moe_dsa",)
    assert module.cuda_engine is glm53.cuda_engine and module.check is glm53.check
    assert module.TITLE == glm53.TITLE and module.QUANT_METHODS == glm53.QUANT_METHODS
