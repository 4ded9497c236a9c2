"""glm53.settings: every TF_GLM53_* knob parsed and checked once, errors that name the variable and
what it accepts, explicit arguments over the environment, README's table generated from the fields,
and no product module reading a knob from the environment itself."""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from glm53.settings import PREFIX, TEST_ONLY, Settings, SettingsError, knobs, markdown_table, parse_bytes, \
    with_table
from tests.fixtures_tiny import TINY_CHUNK, tiny_dirs  # noqa: F401
from lane_fixtures import run_kit_script

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("glm53", "kv_cache", "drafter", "launcher", "seriestool")
SETTINGS_MODULE = Path("glm53/settings.py")
# where Settings.from_env() may run: process entry points, and the public constructors a library
# caller uses without settings (each passes what it parsed down to everything it builds)
ENTRY_POINTS = {
    "glm53/serving/rank.py",  # a rank of the lane, at start
    "glm53/serving/compose.py",  # build_engine: glm53.cuda_engine, the family contract TensorFold's CLI calls
    "glm53/runtime/engine.py",  # Glm53Engine(settings=None)
    "glm53/dist/rank_engine.py",  # RankEngine(settings=None)
    "launcher/config.py",  # serve.sh: checks the variables it forwards before any node is touched
    "launcher/probe.py",  # python -m launcher.probe on each node
    "glm53/settings.py",  # python -m glm53.settings --check
}


def test_defaults_parse_from_an_empty_environment() -> None:
    s = Settings.from_env({})
    assert s == Settings()
    assert (s.max_seqs, s.max_waiting, s.kv_pool_bytes, s.step_tokens) == (8, 64, None, None)
    assert (s.host_cache_bytes, s.disk_cache, s.disk_cache_bytes) == (8 << 30, None, 64 << 30)
    assert (s.prefix_cache, s.dcp, s.draft_relaxed_top2, s.draft_source, s.draft_max_depth) == (True, True, False,
                                                                                                "auto", 13)
    assert (s.device, s.dtype, s.kv_dtype, s.prefill_chunk, s.cache_block) == (None, None, "bf16", None, 256)
    assert (s.log_level, s.api_keys, s.mem_floor_mb) == ("INFO", (), 4096)
    assert Settings.from_env({"PATH": "/bin", "TENSORFOLD_PORT": "1"}) == s  # other variables are not ours


def test_values_parse_to_their_types() -> None:
    s = Settings.from_env({"TF_GLM53_MAX_SEQS": " 16 ", "TF_GLM53_KV_POOL_BYTES": "2G",
                           "TF_GLM53_HOST_CACHE_BYTES": "512MiB",
                           "TF_GLM53_PREFIX_CACHE": "off", "TF_GLM53_DRAFT_RELAXED_TOP2": "yes", "TF_GLM53_DCP": "0",
                           "TF_GLM53_DRAFT_EWMA": "1", "TF_GLM53_HEARTBEAT_S": "0.25", "TF_GLM53_KV_DTYPE": "FP8",
                           "TF_GLM53_LOG_LEVEL": "debug", "TF_GLM53_API_KEYS": " a ,, b,a ",
                           "TF_GLM53_DISK_CACHE": "/tmp/x", "TF_GLM53_MEM_FLOOR_MB": "0"})
    assert (s.max_seqs, s.kv_pool_bytes, s.host_cache_bytes) == (16, 2 << 30, 512 << 20)
    assert (s.prefix_cache, s.draft_relaxed_top2, s.dcp) == (False, True, False)
    assert (s.draft_ewma, s.heartbeat_s, s.kv_dtype, s.log_level) == (1.0, 0.25, "fp8", "DEBUG")
    assert (s.api_keys, s.disk_cache, s.mem_floor_mb) == (("a", "b"), "/tmp/x", 0)
    assert "api_keys" not in repr(s)  # a logged Settings shows no keys
    assert parse_bytes("4kb") == 4096 and parse_bytes("1048576") == 1 << 20


def test_an_empty_value_is_unset() -> None:
    blank = {"TF_GLM53_DISK_CACHE": "", "TF_GLM53_MAX_SEQS": "  ", "TF_GLM53_DEVICE": ""}
    assert Settings.from_env(blank) == Settings()


@pytest.mark.parametrize("name, value, accepted", [
    ("TF_GLM53_MAX_SEQS", "abc", "an integer in 1..64"),  # not an integer
    ("TF_GLM53_MAX_SEQS", "65", "an integer in 1..64"),  # out of range
    ("TF_GLM53_MAX_SEQS", "0", "an integer in 1..64"),
    ("TF_GLM53_PREFILL_CHUNK", "2.5", "a positive integer"),
    ("TF_GLM53_MEM_FLOOR_MB", "-1", "an integer >= 0"),
    ("TF_GLM53_DRAFT_EWMA", "1.5", "a number in (0, 1]"),
    ("TF_GLM53_DRAFT_EWMA", "nan", "a number in (0, 1]"),
    ("TF_GLM53_COLLECTIVE_TIMEOUT_S", "0", "a positive number of seconds"),
    ("TF_GLM53_KV_DTYPE", "int4", "one of bf16, fp8, fp32"),  # not one of the choices
    ("TF_GLM53_DRAFT_SOURCE", "fast", "one of auto, off, copy, mtp, dflash2"),
    ("TF_GLM53_LOG_LEVEL", "LOUD", "one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ("TF_GLM53_HOST_CACHE_BYTES", "8X", "a byte count like 8G, 512M or 1048576"),  # a bad byte size
    ("TF_GLM53_KV_POOL_BYTES", "0", "a positive byte count like 8G or 1048576"),
    ("TF_GLM53_PREFIX_CACHE", "maybe", "1 or 0 (also true/false, yes/no, on/off)"),
    ("TF_GLM53_DCP", "yes", "1 or 0"),
])
def test_a_bad_value_names_the_variable_the_value_and_what_is_accepted(name: str, value: str, accepted: str) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({name: value})
    assert str(info.value) == f"{name}={value!r}: expected {accepted}"
    assert isinstance(info.value, ValueError)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"TF_GLM53_MAX_SEQS": "abc", "TF_GLM53_HOST_CACHE_BYTES": "8X", "TF_GLM53_MAX_SEQ": "4"})
    text = str(info.value)
    assert "TF_GLM53_MAX_SEQS='abc'" in text and "TF_GLM53_HOST_CACHE_BYTES='8X'" in text
    assert "TF_GLM53_MAX_SEQ is not a variable the kit reads (did you mean TF_GLM53_MAX_SEQS?)" in text


def test_a_misspelt_name_is_an_error_naming_the_closest_knob() -> None:
    with pytest.raises(SettingsError, match=re.escape("TF_GLM53_PREFIX_CACH is not a variable the kit reads "
                                                      "(did you mean TF_GLM53_PREFIX_CACHE?)")):
        Settings.from_env({"TF_GLM53_PREFIX_CACH": "0"})
    with pytest.raises(SettingsError, match="^TF_GLM53_NOTHING_LIKE_IT is not a variable the kit reads; "
                                            "`python -m glm53.settings --markdown` lists them$"):
        Settings.from_env({"TF_GLM53_NOTHING_LIKE_IT": "1"})
    # the GPU tests' own variables are not knobs, and not errors either
    assert Settings.from_env({name: "/tmp/x" for name in TEST_ONLY}) == Settings()


def test_explicit_values_override_and_are_checked() -> None:
    env = Settings.from_env({"TF_GLM53_MAX_SEQS": "4", "TF_GLM53_CUDA_GRAPHS": "0"})
    s = env.override(max_seqs=12, cuda_graphs=None, kv_dtype="FP8")
    assert (s.max_seqs, s.cuda_graphs, s.kv_dtype) == (12, "0", "fp8") and env.max_seqs == 4
    assert env.override() is env and env.override(max_seqs=None) is env
    with pytest.raises(SettingsError, match="TF_GLM53_MAX_SEQS=65: expected an integer in 1..64"):
        env.override(max_seqs=65)
    with pytest.raises(SettingsError, match="TF_GLM53_CUDA_GRAPHS='sometimes': expected one of auto, 1, 0"):
        env.override(cuda_graphs="sometimes")
    with pytest.raises(SettingsError, match="TF_GLM53_PREFIX_CACHE=1: expected 1 or 0"):
        Settings(prefix_cache=1)  # a flag takes a bool, not a number
    with pytest.raises(TypeError, match="no field"):
        env.override(max_seq=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.max_seqs = 3  # type: ignore[misc]


def test_the_modules_own_defaults_are_the_settings_ones() -> None:
    """Constructors keep defaults for callers without settings; they must be the knobs' defaults."""
    from drafter.policy import MAX_DEPTH, PolicyConfig
    from glm53.serving.front.settings import FrontSettings
    from glm53.runtime.cuda_graphs import GRAPH_CHOICES
    from glm53.dist.guard import GuardSettings
    from kv_cache.cache import DEFAULT_HOST_BYTES

    s = Settings()
    assert PolicyConfig.from_settings(s) == PolicyConfig() and MAX_DEPTH == s.draft_max_depth
    assert GuardSettings.from_settings(s) == GuardSettings()
    assert FrontSettings().max_waiting == s.max_waiting and DEFAULT_HOST_BYTES == s.host_cache_bytes
    assert set(GRAPH_CHOICES) == set(knobs()["cuda_graphs"].kind.values)


def test_the_engine_takes_settings_and_its_options_win(tiny_dirs, monkeypatch) -> None:  # noqa: F811
    from glm53.runtime.engine import Glm53Engine

    # given settings, the engine reads nothing from the environment
    monkeypatch.setenv("TF_GLM53_PREFILL_CHUNK", "not read")
    settings = Settings(prefill_chunk=2 * TINY_CHUNK, max_seqs=3, device="cpu", dtype="fp32", kv_dtype="fp32")
    engine = Glm53Engine(tiny_dirs.model, settings=settings, prefill_chunk=TINY_CHUNK)
    assert engine.chunk == TINY_CHUNK and engine.settings.prefill_chunk == TINY_CHUNK
    assert engine.settings.max_seqs == 3 and engine.wave == 4 * TINY_CHUNK
    assert engine.batch_engine().scheduler.max_seqs == 3  # the runtime reads the engine's settings
    assert engine.batch_engine(max_seqs=2).scheduler.max_seqs == 2  # and its own options win


def test_readme_knob_table_is_generated_from_the_settings() -> None:
    readme = (ROOT / "README.md").read_text()
    assert with_table(readme) == readme, (
        "README.md's knob table differs from glm53/settings.py: run "
        "`.venv/bin/python -m glm53.settings --update-readme` and commit README.md")
    assert len(re.findall(r"^\| `TF_GLM53_", markdown_table(), re.M)) == len(knobs()) == 32


def _product_files() -> list[Path]:
    return sorted(p.relative_to(ROOT) for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py"))


def test_no_product_module_reads_a_knob_itself() -> None:
    """Outside glm53/settings.py a knob's name appears only inside messages and docs: never as a
    string of its own (an environment key, a constant to look one up with). Code that writes a
    child's environment takes the names from glm53.settings.env_name."""
    found = []
    for rel in _product_files():
        if rel == SETTINGS_MODULE:
            continue
        for node in ast.walk(ast.parse((ROOT / rel).read_text(), str(rel))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    re.fullmatch(r"TF_GLM53_[A-Z0-9_]*", node.value)):
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found, "read through glm53.settings.Settings instead:\n" + "\n".join(found)


def test_settings_are_parsed_from_the_environment_only_at_entry_points() -> None:
    found = set()
    for rel in _product_files():
        if "Settings.from_env(" in (ROOT / rel).read_text():
            found.add(rel.as_posix())
    assert found <= ENTRY_POINTS, sorted(found - ENTRY_POINTS)


def test_every_knob_named_in_the_code_and_scripts_exists() -> None:
    """Messages, docstrings, scripts and the example cluster file name only knobs that exist."""
    known = {k.env for k in knobs().values()} | set(TEST_ONLY)
    paths = _product_files() + [p.relative_to(ROOT) for p in ROOT.glob("*.sh")] + [Path("cluster.example.yaml")]
    stale = set()
    for rel in paths:
        for name in re.findall(rf"{PREFIX}[A-Z0-9_]*[A-Z0-9]", (ROOT / rel).read_text()):
            if name not in known:
                stale.add(f"{rel}: {name}")
    assert not stale, sorted(stale)


def test_the_launcher_checks_the_knobs_the_ranks_will_get() -> None:
    from launcher.config import ConfigError, check_knobs, local_lane

    lane = dataclasses.replace(local_lane(1, device="cpu"), env={"TF_GLM53_KV_DTYPE": "int4"}, source="c.yaml")
    with pytest.raises(ConfigError, match=re.escape("c.yaml: env: TF_GLM53_KV_DTYPE='int4': expected one of bf16")):
        check_knobs(lane, {})
    with pytest.raises(ConfigError, match=re.escape("environment: TF_GLM53_MAX_SEQS='abc': expected an integer")):
        check_knobs(dataclasses.replace(lane, env={}), {"TF_GLM53_MAX_SEQS": "abc"})
    check_knobs(lane, {"TF_GLM53_KV_DTYPE": "fp8"})  # the environment's value replaces the file's


def test_serve_sh_stops_at_a_bad_value_naming_it() -> None:
    from launcher.config import free_port

    port = str(free_port())
    r = run_kit_script("serve.sh", "--local", "--port", port, env={"TF_GLM53_MAX_SEQS": "abc", "DRY_RUN": "1"},
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert "environment: TF_GLM53_MAX_SEQS='abc': expected an integer in 1..64" in r.stderr
    assert "Traceback" not in r.stderr
    # stop starts nothing: it works whatever the environment holds
    r = run_kit_script("serve.sh", "stop", "--port", port, env={"TF_GLM53_MAX_SEQS": "abc"}, timeout=120)
    assert r.returncode == 0 and "nothing to stop" in r.stderr, r.stderr
