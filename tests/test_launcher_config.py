"""Cluster file, environment and flags: precedence, forwarding, and errors that name the field."""
from __future__ import annotations

from pathlib import Path

import pytest

from launcher import commands
from launcher.config import ConfigError, load_cluster, with_environment, with_flags

ROOT = Path(__file__).resolve().parents[1]


def test_example_cluster_file_is_valid_and_complete() -> None:
    config = load_cluster(ROOT / "cluster.example.yaml")
    assert config.ranks == 4 and [n.rank for n in config.nodes] == [0, 1, 2, 3]
    assert config.port == 8300 and config.served_model == "glm-5.3-exl3"
    assert all(n.fabric for n in config.nodes) and config.runtime.venv
    text = (ROOT / "cluster.example.yaml").read_text()
    for field in ("nodes:", "host:", "user:", "rank:", "fabric:", "model:", "runtime:", "port:", "served_model:",
                  "context:", "kv_dtype:", "drafting:", "env:", "memory:"):
        assert field in text


def write(tmp: Path, body: str) -> Path:
    path = tmp / "cluster.yaml"
    path.write_text(body)
    return path


BASE = """
nodes:
  - {host: a, rank: 0, fabric: 10.0.0.1}
  - {host: b, rank: 1}
model: /models/glm
runtime: {venv: /opt/glm53}
port: 9000
env: {TF_GLM53_PREFILL_CHUNK: "1024"}
"""


def test_environment_overrides_file_and_flags_override_both(tmp_path: Path) -> None:
    config = load_cluster(write(tmp_path, BASE))
    assert config.port == 9000 and config.master() == "10.0.0.1"
    env = {"TENSORFOLD_PORT": "9100", "TENSORFOLD_CONTEXT": "65536", "TF_GLM53_KV_DTYPE": "fp8",
           "TENSORFOLD_LOG": "debug", "HOME": "/root"}
    config = with_environment(config, env)
    assert config.port == 9100 and config.context == 65536
    assert config.env == {"TF_GLM53_PREFILL_CHUNK": "1024", "TF_GLM53_KV_DTYPE": "fp8", "TENSORFOLD_LOG": "debug",
                          "TENSORFOLD_PORT": "9100", "TENSORFOLD_CONTEXT": "65536"}
    config = with_flags(config, port=9200, context=None)
    assert config.port == 9200 and config.context == 65536
    # forwarded to every rank, on the rank's command line
    for node in config.nodes:
        cmd = commands.rank_command(config, node, config.model)
        assert "TF_GLM53_KV_DTYPE=fp8" in cmd and "TENSORFOLD_LOG=debug" in cmd and "HOME=" not in cmd
        assert f"--rank {node.rank} --ranks 2 --master 10.0.0.1" in cmd
    assert "--port 9200" in commands.rank_command(config, config.nodes[0], "/m")
    assert "--port" not in commands.rank_command(config, config.nodes[1], "/m")


@pytest.mark.parametrize("body, words", [
    (BASE.replace("model: /models/glm\n", ""), ["model", "required"]),
    (BASE.replace("rank: 1", "rank: 0"), ["ranks must be 0..1"]),
    (BASE + "kv_dtype: int4\n", ["kv_dtype", "int4"]),
    (BASE + "colour: blue\n", ["unknown field 'colour'"]),
    (BASE.replace("{host: b, rank: 1}", "{host: b, rank: one}"), ["nodes[1].rank", "int"]),
    (BASE.replace("{host: b, rank: 1}", "{host: b, rank: 1, gpu: 0}"), ["nodes[1].gpu"]),
    (BASE.replace("runtime: {venv: /opt/glm53}", "runtime: {}"), ["runtime", "venv", "image"]),
    ("nodes: [\n", ["not valid YAML"]),
])
def test_bad_cluster_files_name_file_and_field(tmp_path: Path, body: str, words: list[str]) -> None:
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message


def test_bad_environment_value_is_named() -> None:
    config = load_cluster(ROOT / "cluster.example.yaml")
    with pytest.raises(ConfigError, match="TENSORFOLD_PORT='eighty'"):
        with_environment(config, {"TENSORFOLD_PORT": "eighty"})


def test_runtime_key_changes_with_a_patch(tmp_path: Path) -> None:
    (tmp_path / "series").write_text("upstream x v1 " + "0" * 40 + "\n")
    (tmp_path / "patches").mkdir()
    before = commands.runtime_key(tmp_path)
    (tmp_path / "patches" / "0001-a.patch").write_text("diff\n")
    after = commands.runtime_key(tmp_path)
    assert before != after and after == commands.runtime_key(tmp_path)


def test_image_runtime_commands_run_in_the_container(tmp_path: Path) -> None:
    config = load_cluster(write(tmp_path, BASE.replace("runtime: {venv: /opt/glm53}", "runtime: {image: glm53:1}")))
    node = config.nodes[1]
    start = commands.rank_command(config, node, "/models/glm")
    assert "exec docker run --rm --name glm53-rank1-9000 --gpus all --network host" in start
    assert "-v /models/glm:/models/glm" in start and "-e TF_GLM53_PREFILL_CHUNK=1024" in start
    assert " glm53:1 python -m glm53.serving.rank --model /models/glm --rank 1 --ranks 2" in start
    assert commands.probe_command(config, "/models/glm").startswith("docker run --rm --gpus all")
    assert "docker stop -t 10 glm53-rank1-9000" in commands.stop_command(config, node)
    # rank 0 drains before it stops: the supervisor gives its container the drain's time
    assert "docker stop -t 30 glm53-rank0-9000" in commands.stop_command(config, config.nodes[0], "TERM", 30)
    assert "glm53.runtime-key" in commands.prepare_command(config, "k")


def test_the_ranks_cache_knobs_set_the_planned_layout(tmp_path: Path) -> None:
    """TF_GLM53_KV_DTYPE / TF_GLM53_DCP reach the ranks; the lane's kv_dtype and dcp (what the memory
    plan sizes) follow them, so the plan describes the cache the ranks allocate; a TENSORFOLD_KV_DTYPE
    that says otherwise is refused naming both."""
    config = with_environment(load_cluster(write(tmp_path, BASE)), {"TF_GLM53_KV_DTYPE": "FP8", "TF_GLM53_DCP": "0"})
    assert (config.kv_dtype, config.dcp) == ("fp8", False)
    cmd = commands.rank_command(config, config.nodes[0], config.model)
    assert "kv_dtype=fp8" in cmd and "TF_GLM53_DCP=0" in cmd
    assert with_environment(load_cluster(write(tmp_path, BASE)), {}).dcp is True  # the file's default stands
    with pytest.raises(ConfigError, match="TF_GLM53_KV_DTYPE=.fp8. and TENSORFOLD_KV_DTYPE=.bf16. disagree; unset one"):
        with_environment(load_cluster(write(tmp_path, BASE)), {"TF_GLM53_KV_DTYPE": "fp8", "TENSORFOLD_KV_DTYPE": "bf16"})
