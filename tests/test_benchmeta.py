"""bench.lib.meta: the commit a result names (in a git checkout, dirty, and in a copy without .git),
summaries, the atomic JSON write, and the header every bench result starts with."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib import meta
from bench.lib.meta import git_commit, result_header
from glm53.measurement import summary, versions, write_json

REPO = Path(__file__).resolve().parents[1]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def isolated_env(tmp_path, monkeypatch):
    """git must not find a repository above tmp_path, nor read the user's config."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.delenv("GLM53_KIT_COMMIT", raising=False)
    return tmp_path


def test_commit_of_a_real_repo_clean_then_dirty(isolated_env):
    repo = isolated_env / "kit"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(repo, "rev-parse", "HEAD")
    assert git_commit(repo) == head
    (repo / "untracked.txt").write_text("not part of the kit\n")
    assert git_commit(repo) == head, "untracked files must not mark the tree dirty"
    (repo / "a.py").write_text("x = 2\n")
    assert git_commit(repo) == head + "-dirty"


def test_copy_without_git_reports_env_commit_else_unknown(isolated_env):
    """The GPU machine gets the kit without .git: the bench module, run from such a copy, names the
    commit from GLM53_KIT_COMMIT, and says "unknown" without it."""
    copy = isolated_env / "copy"
    shutil.copytree(REPO / "bench", copy / "bench", ignore=shutil.ignore_patterns("results", "__pycache__"))
    assert not (copy / ".git").exists()
    probe = "from bench.lib.meta import git_commit; print(git_commit())"
    env = {k: v for k, v in os.environ.items() if k != "GLM53_KIT_COMMIT"}
    run = lambda e: subprocess.run([sys.executable, "-c", probe], cwd=copy, env=e, capture_output=True,  # noqa: E731
                                   text=True, check=True).stdout.strip()
    assert run(env) == "unknown"
    assert run({**env, "GLM53_KIT_COMMIT": "0123abcd"}) == "0123abcd"


def test_env_commit_names_the_copy_even_over_a_checkout(isolated_env, monkeypatch):
    """A copy of the tree may carry a stale .git (naming an older commit, dirty, for a run of a later
    one): a commit the operator names wins over what git says there."""
    repo = isolated_env / "kit"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "e")
    assert git_commit(repo) == _git(repo, "rev-parse", "HEAD")
    monkeypatch.setenv("GLM53_KIT_COMMIT", "from-env")
    assert git_commit(repo) == "from-env"


def test_summary_plain_and_with_unit():
    assert summary([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    assert summary([0.5], unit="s") == {"median_s": 0.5, "min_s": 0.5, "max_s": 0.5, "n": 1}
    with pytest.raises(ValueError, match="no samples"):
        summary([])


def test_write_json_replaces_whole_file_and_leaves_no_temp(tmp_path):
    out = tmp_path / "deep" / "r.json"
    write_json(out, {"a": 1})
    assert json.loads(out.read_text()) == {"a": 1}
    write_json(out, {"b": [1, 2]})
    assert json.loads(out.read_text()) == {"b": [1, 2]}
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]


def test_write_json_failure_keeps_old_file_and_removes_temp(tmp_path):
    out = tmp_path / "r.json"
    write_json(out, {"old": True})
    with pytest.raises(TypeError):
        write_json(out, {"new": object()})  # not JSON-serialisable: fails mid-write
    assert json.loads(out.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_versions_and_header():
    v = versions(extra=("surely-not-installed-pkg",))
    assert v["python"].count(".") == 2
    assert v["surely-not-installed-pkg"] == "absent"
    import torch

    assert v["torch"] == torch.__version__
    h = result_header("demo", {"dtype": "bf16"}, device="cpu")
    assert h["bench"] == "demo" and h["settings"] == {"dtype": "bf16"}
    assert h["git_commit"] == git_commit()
    assert h["device"] == f"{meta.cpu_model()} ({os.cpu_count()} cores)"
    assert h["cpu_cores"] == os.cpu_count() and h["torch_threads"] == torch.get_num_threads()
    assert set(h["versions"]) >= {"python", "torch", "triton"}
