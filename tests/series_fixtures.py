"""Real git repositories for the series-tool tests: a small upstream with three tags and a kit
(series + patches/) whose patches are made by committing on the upstream and exporting.

Upstream history (on `main` unless said):
  A  v0.6.0 (annotated)    cli_args.py, server.py, README.md ("teh engine"), families glm5_next
                           (MODEL_TYPES a list) and llama (imported from .config, via a constant)
  A2 v0.6.1 (lightweight)  server.py edited; README typo fixed (absorbs patch 0003)
  B  v0.7.0 (annotated)    TP_CHOICES changed to (1, 2, 8): conflicts with patch 0002
  C  v0.8.0 (annotated)    adds families/glm_moe_dsa_full claiming glm_moe_dsa: clashes with 0001
  D  v0.6.6 (annotated)    on a side branch from A2: the same full family, no conflict with 0002
Kit patches on v0.6.0: 0001 adds the kit's family glm53 (MODEL_TYPES a tuple with glm_moe_dsa),
0002 lifts TP/rank choices, 0003 fixes the typo.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from seriestool.git_ops import ISOLATED_ENV, Workdir

GUARD_TEST = "def test_guard():\n    assert True\n"
CLI_ARGS = "".join(f"# option block {i}\n" for i in range(8)) + \
    "TP_CHOICES = (1, 2)\nRANK_CHOICES = (0, 1)\n" + "".join(f"# tail {i}\n" for i in range(8))
README = "TensorFold\n\nThe fast teh engine.\n\nSee docs.\n"
SERVER = "def serve():\n    return 'ok'\n"
FAMILIES = "src/tensorfold/families"
FULL_FAMILY = f"{FAMILIES}/glm_moe_dsa_full/__init__.py"
KIT_FAMILY = f"{FAMILIES}/glm53/__init__.py"

NAMES = ["0001-register-glm53-family.patch", "0002-lift-two-rank-limit.patch",
         "0003-fix-readme-typo.patch"]


def git(cwd: Path, *args: str, date: str | None = None, check: bool = True) -> str:
    env = {**os.environ, **ISOLATED_ENV, "GIT_AUTHOR_NAME": "Test Author",
           "GIT_AUTHOR_EMAIL": "author@example.invalid"}
    if date:
        env["GIT_AUTHOR_DATE"] = env["GIT_COMMITTER_DATE"] = date
    out = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {out.stdout}{out.stderr}")
    return out.stdout.strip()


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def message(subject: str, guard: str = "tests/test_guard.py::test_guard") -> str:
    return (f"{subject}\n\nWhat: {subject}.\nWhy: upstream needs it for the kit.\n"
            f"Verified: the fixture tests.\nNot verified: nothing on a GPU.\nGuarded-By: {guard}\n")


@dataclass
class Upstream:
    path: Path
    a: str
    a2: str
    b: str
    c: str
    d: str
    patches: dict[str, bytes]      # normalized exports of the three kit patches on v0.6.0
    raw_patch_0001: bytes          # plain `git format-patch` output (diffstat, signature): stale


def build_upstream(root: Path) -> Upstream:
    up = root / "upstream"
    up.mkdir()
    git(up, "init", "-q", "-b", "main")
    write(up, "src/tensorfold/cli_args.py", CLI_ARGS)
    write(up, f"{FAMILIES}/__init__.py", '"""families are found by iterating this package"""\n')
    write(up, f"{FAMILIES}/glm5_next/__init__.py", "MODEL_TYPES = ['glm5_next']\n")
    write(up, f"{FAMILIES}/llama/__init__.py", "from .config import MODEL_TYPES\n")
    write(up, f"{FAMILIES}/llama/config.py", "LLAMA = 'llama'\nMODEL_TYPES = (LLAMA, 'llama3')\n")
    write(up, "src/tensorfold/server.py", SERVER)
    write(up, "README.md", README)
    git(up, "add", "-A")
    git(up, "commit", "-qm", "v0.6.0", date="2026-09-30T12:00:00Z")
    git(up, "tag", "-a", "v0.6.0", "-m", "release 0.6.0", date="2026-09-30T12:00:00Z")
    a = git(up, "rev-parse", "HEAD")
    write(up, "src/tensorfold/server.py", SERVER + "\n\ndef health():\n    return 'up'\n")
    write(up, "README.md", README.replace("teh", "the"))
    git(up, "commit", "-qam", "0.6.1: health, typo", date="2026-10-10T12:00:00Z")
    git(up, "tag", "v0.6.1")
    a2 = git(up, "rev-parse", "HEAD")
    write(up, "src/tensorfold/cli_args.py", CLI_ARGS.replace("(1, 2)\n", "(1, 2, 8)\n"))
    git(up, "commit", "-qam", "0.7.0: tp 8", date="2026-11-01T12:00:00Z")
    git(up, "tag", "-a", "v0.7.0", "-m", "release 0.7.0", date="2026-11-01T12:00:00Z")
    b = git(up, "rev-parse", "HEAD")
    write(up, FULL_FAMILY, "# the full GLM-5.3 model\nMODEL_TYPES = (\"glm_moe_dsa\",)\n")
    git(up, "add", "-A")
    git(up, "commit", "-qm", "0.8.0: full GLM-5.3 family", date="2026-11-20T12:00:00Z")
    git(up, "tag", "-a", "v0.8.0", "-m", "release 0.8.0", date="2026-11-20T12:00:00Z")
    c = git(up, "rev-parse", "HEAD")
    git(up, "checkout", "-q", "-b", "stable-0.6", a2)
    write(up, FULL_FAMILY, "# the full GLM-5.3 model\nMODEL_TYPES = (\"glm_moe_dsa\",)\n")
    git(up, "add", "-A")
    git(up, "commit", "-qm", "0.6.6: full GLM-5.3 family", date="2026-11-21T12:00:00Z")
    git(up, "tag", "-a", "v0.6.6", "-m", "release 0.6.6", date="2026-11-21T12:00:00Z")
    d = git(up, "rev-parse", "HEAD")
    git(up, "checkout", "-q", "main")

    work = root / "patchwork"
    git(root, "clone", "-q", str(up), str(work))
    git(work, "checkout", "-q", "-b", "kit", a)
    write(work, KIT_FAMILY, "MODEL_TYPES = ('glm_moe_dsa',)\n")
    git(work, "add", "-A")
    git(work, "commit", "-qm", message("families: register the glm53 family"), date="2026-10-02T09:00:00Z")
    write(work, "src/tensorfold/cli_args.py", CLI_ARGS.replace("(1, 2)\n", "(1, 2, 4)\n")
          .replace("(0, 1)\n", "(0, 1, 2, 3)\n"))
    git(work, "commit", "-qam", message("cli: lift the two-rank limit"), date="2026-10-02T09:01:00Z")
    write(work, "README.md", README.replace("teh", "the"))
    git(work, "commit", "-qam", message("README: fix a typo"), date="2026-10-02T09:02:00Z")
    commits = git(work, "rev-list", "--reverse", f"{a}..HEAD").split()
    wd = Workdir(work)
    patches = {name: wd.format_patch(c) for name, c in zip(NAMES, commits)}
    raw = subprocess.run(["git", "format-patch", "--stdout", "-1", commits[0]], cwd=work,
                         env={**os.environ, **ISOLATED_ENV}, capture_output=True, check=True).stdout
    return Upstream(up, a, a2, b, c, d, patches, raw)


@dataclass
class Kit:
    root: Path
    series: Path
    workdir: Path
    upstream: Upstream

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    def args(self, *words: str, repo: str | Path | None = None) -> list[str]:
        """CLI arguments for this kit: words, then --series/--workdir/--repo."""
        source = str(self.upstream.path) if repo is None else str(repo)
        return [*words, "--series", str(self.series), "--workdir", str(self.workdir), "--repo", source]

    def snapshot(self) -> dict[str, bytes]:
        files = {"series": self.series.read_bytes()}
        for path in sorted(self.patches.iterdir()):
            files[path.name] = path.read_bytes()
        return files


def make_kit(root: Path, upstream: Upstream, names: list[str] | None = None, tag: str = "v0.6.0",
             commit: str | None = None, url: str = "https://example.invalid/TensorFold") -> Kit:
    names = list(NAMES if names is None else names)
    root.mkdir(parents=True, exist_ok=True)
    (root / "patches").mkdir()
    write(root, "tests/test_guard.py", GUARD_TEST)
    for name in names:
        if name in upstream.patches:
            (root / "patches" / name).write_bytes(upstream.patches[name])
    lines = ["# test series", f"upstream {url} {tag} {commit or upstream.a}", *names]
    (root / "series").write_text("\n".join(lines) + "\n")
    return Kit(root, root / "series", root / "build" / "tensorfold", upstream)


def copy_upstream(upstream: Upstream, dest: Path) -> Path:
    shutil.copytree(upstream.path, dest, symlinks=True)
    return dest
