"""fetch_weights.sh against a real HTTP server on loopback that speaks the part of the Hugging Face
hub API huggingface_hub uses (repo info with file metadata, recursive tree, resolve with HEAD/GET
and Range). The hub itself is the mock; huggingface_hub, the HTTP stack and the files are real.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from glm53.checkpoints.manifest import MANIFEST_NAME, load_manifest
from glm53.synthetic.checkpoints import tiny_config, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
REPO = "vcruz305/GLM-5.3-EXL3-3.38bpw"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors",)


class FakeHub:
    """Serves model repos from folders; LFS-style metadata for *.safetensors."""

    def __init__(self, folder: Path, repo: str = REPO, commit: str = COMMIT, extra: dict[str, Path] | None = None) -> None:
        self.repo, self.commit = repo, commit
        self.requests: Counter[str] = Counter()
        self.repos: dict[str, tuple[Path, dict[str, dict]]] = {}
        for name, src in {repo: folder, **(extra or {})}.items():
            files = {}
            for p in sorted(src.iterdir()):
                data = p.read_bytes()
                blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
                sha = hashlib.sha256(data).hexdigest() if p.suffix in LFS_SUFFIXES else None
                files[p.name] = {"size": len(data), "blob": blob, "sha256": sha}
            self.repos[name] = (src, files)
        self.files = self.repos[repo][1]
        self.api_status: int | None = None  # set to e.g. 503 to make the API fail
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def _json(self, obj: object, status: int = 200, headers: dict[str, str] | None = None) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _serve(self, head: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests[f"{self.command} {path}"] += 1
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and hub.api_status:
                    return self._json({"error": "unavailable"}, hub.api_status)
                if parts[:2] == ["api", "models"]:
                    repo, rest = "/".join(parts[2:4]), parts[4:]
                    if repo not in hub.repos:
                        return self._json({"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"})
                    files = hub.repos[repo][1]
                    if rest[:1] == ["revision"]:
                        return self._json({"id": repo, "modelId": repo, "sha": hub.commit, "private": False,
                                           "siblings": [hub.sibling(files, n) for n in files]})
                    if rest[:1] == ["tree"]:
                        return self._json([hub.tree_entry(files, n) for n in files])
                repo = "/".join(parts[:2])
                if repo in hub.repos and parts[2:3] == ["resolve"]:
                    name = "/".join(parts[4:])
                    if name not in hub.repos[repo][1]:
                        return self._json({"error": "Entry not found"}, 404, {"X-Error-Code": "EntryNotFound"})
                    return self._file(repo, name, head)
                self._json({"error": "not found"}, 404)

            def _file(self, repo: str, name: str, head: bool) -> None:
                folder, files = hub.repos[repo]
                meta = files[name]
                data = (folder / name).read_bytes()
                start, end = 0, len(data)
                rng = self.headers.get("Range")
                status = 200
                if rng and rng.startswith("bytes="):
                    a, _, b = rng[6:].partition("-")
                    start, end, status = int(a), (int(b) + 1 if b else len(data)), 206
                self.send_response(status)
                self.send_header("X-Repo-Commit", hub.commit)
                if meta["sha256"]:
                    self.send_header("X-Linked-Etag", f'"{meta["sha256"]}"')
                    self.send_header("X-Linked-Size", str(meta["size"]))
                self.send_header("ETag", f'"{meta["sha256"] or meta["blob"]}"')
                self.send_header("Content-Length", str(end - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                self.end_headers()
                if not head:
                    self.wfile.write(data[start:end])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @staticmethod
    def sibling(files: dict[str, dict], name: str) -> dict:
        m = files[name]
        d = {"rfilename": name, "size": m["size"], "blobId": m["blob"]}
        if m["sha256"]:
            d["lfs"] = {"sha256": m["sha256"], "size": m["size"], "pointerSize": 134}
        return d

    @staticmethod
    def tree_entry(files: dict[str, dict], name: str) -> dict:
        m = files[name]
        d = {"type": "file", "path": name, "size": m["size"], "oid": m["blob"]}
        if m["sha256"]:
            d["lfs"] = {"oid": m["sha256"], "size": m["size"], "pointerSize": 134}
        return d

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def gets(self, suffix: str) -> int:
        return sum(n for k, n in self.requests.items() if k.startswith("GET") and k.endswith(suffix))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("hubrepo"), tiny_config(), n_shards=3, seed=3)


def hub_env(endpoint: str, hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_ETAG_TIMEOUT="5")
    return env


def fetch(args: list[str], endpoint: str, hf_home: Path) -> subprocess.CompletedProcess:
    """fetch_weights.sh with stdin not a terminal (as in CI and scripts)."""
    return subprocess.run(["bash", str(ROOT / "fetch_weights.sh"), *args], capture_output=True, text=True, timeout=180,
                          env=hub_env(endpoint, hf_home), stdin=subprocess.DEVNULL)


def dead_endpoint() -> str:
    """A loopback port nobody listens on (bound, then closed)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def test_download_verify_then_offline_deep(source: Path, tmp_path: Path) -> None:
    dest, hf_home, report = tmp_path / "model", tmp_path / "hf", tmp_path / "r.json"
    with FakeHub(source) as hub:
        proc = fetch(["--dir", str(dest), "--json", str(report)], hub.url, hf_home)
        assert proc.returncode == 0, proc.stderr
        assert "no pinned revision" in proc.stderr  # the placeholder is honest about itself
        for p in source.iterdir():
            assert (dest / p.name).read_bytes() == p.read_bytes(), p.name
        manifest = load_manifest(dest)
        assert manifest is not None and manifest.commit == COMMIT and manifest.revision == "main"
        for name, meta in hub.files.items():
            assert manifest.files[name].size == meta["size"]
            assert manifest.files[name].sha256 == meta["sha256"]
        doc = json.loads(report.read_text())
        assert doc["status"] == "ok" and doc["source"]["commit"] == COMMIT and doc["source"]["online"] is True
        shard_gets = hub.gets(".safetensors")
        assert shard_gets == 3
        # a second run finds the files complete and does not fetch them again
        proc = fetch(["--dir", str(dest), "--revision", COMMIT], hub.url, hf_home)
        assert proc.returncode == 0, proc.stderr
        assert hub.gets(".safetensors") == shard_gets
    # hub gone: falls back to the local copy, hashes it against what the hub recorded
    proc = fetch(["--dir", str(dest), "--deep"], dead_endpoint(), hf_home)
    assert proc.returncode == 0, proc.stderr
    assert "unreachable" in proc.stderr and "3 files hashed, 0 mismatches" in proc.stdout
    shard = sorted(dest.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x55
    shard.write_bytes(bytes(data))
    proc = fetch(["--dir", str(dest), "--deep", "--offline"], dead_endpoint(), hf_home)
    assert proc.returncode == 1 and shard.name in proc.stderr and "SHA-256" in proc.stderr


def test_download_into_cache_then_offline(source: Path, tmp_path: Path) -> None:
    hf_home = tmp_path / "hf"
    with FakeHub(source) as hub:
        proc = fetch(["--revision", "main"], hub.url, hf_home)
        assert proc.returncode == 0, proc.stderr
    snapshot = hf_home / "hub" / "models--vcruz305--GLM-5.3-EXL3-3.38bpw" / "snapshots" / COMMIT
    assert (snapshot / MANIFEST_NAME).is_file() and (snapshot / "model.safetensors.index.json").exists()
    proc = fetch(["--offline", "--deep"], dead_endpoint(), hf_home)
    assert proc.returncode == 0, proc.stderr
    assert str(snapshot) in proc.stdout and "0 mismatches" in proc.stdout


def test_unreachable_hub_without_local_copy(tmp_path: Path) -> None:
    proc = fetch(["--dir", str(tmp_path / "empty"), "--json", str(tmp_path / "r.json")], dead_endpoint(), tmp_path / "hf")
    assert proc.returncode == 4
    assert "unreachable" in proc.stderr and "no local copy" in proc.stderr and "--dir" in proc.stderr
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "no_checkpoint"
    proc = fetch(["--offline"], dead_endpoint(), tmp_path / "hf")
    assert proc.returncode == 4 and "Hugging Face cache" in proc.stderr


def test_repo_not_found(source: Path, tmp_path: Path) -> None:
    with FakeHub(source) as hub:
        proc = fetch(["--repo", "someone/else", "--dir", str(tmp_path / "m")], hub.url, tmp_path / "hf")
    assert proc.returncode == 4 and "someone/else" in proc.stderr and "not found" in proc.stderr


def test_hub_serving_a_damaged_shard_is_caught(source: Path, tmp_path: Path) -> None:
    """A mirror that serves a truncated shard with matching Content-Length: the header check names it."""
    bad_repo = tmp_path / "badrepo"
    shutil.copytree(source, bad_repo)
    shard = sorted(bad_repo.glob("*.safetensors"))[0]
    os.truncate(shard, shard.stat().st_size - 64)
    with FakeHub(bad_repo) as hub:
        proc = fetch(["--dir", str(tmp_path / "m"), "--revision", COMMIT], hub.url, tmp_path / "hf")
    assert proc.returncode == 1
    assert shard.name in proc.stderr and "truncated" in proc.stderr


def test_hub_5xx_falls_back_to_local_copy(source: Path, tmp_path: Path) -> None:
    dest, hf_home = tmp_path / "model", tmp_path / "hf"
    with FakeHub(source) as hub:
        assert fetch(["--dir", str(dest), "--revision", COMMIT], hub.url, hf_home).returncode == 0
        hub.api_status = 503
        proc = fetch(["--dir", str(dest), "--revision", COMMIT], hub.url, hf_home)
        assert proc.returncode == 0, proc.stderr
        assert "503" in proc.stderr and "local copy" in proc.stderr
        proc = fetch(["--dir", str(tmp_path / "empty"), "--revision", COMMIT], hub.url, hf_home)
        assert proc.returncode == 4 and "no local copy" in proc.stderr


# --- the DFlash2 drafter: --drafter, driven by drafter/MANIFEST.json ---

DRAFTER_REPO = "incoai/GLM-5.3-DFlash2"


@pytest.fixture(scope="module")
def drafter_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny real DFlash2 drafter as the hub repo, plus files the manifest's allow_patterns leave out."""
    from drafter.tiny_dflash import write_tiny_dflash2

    src = write_tiny_dflash2(tmp_path_factory.mktemp("drafter_repo"), vocab_size=16, hidden_size=16, target_layer_ids=[0])
    (src / "LICENSE").write_text("CC BY-NC-ND 4.0\n")
    (src / "training_args.bin").write_bytes(b"not for us" * 10)
    return src


def drafter_hub(source: Path, drafter_src: Path) -> FakeHub:
    return FakeHub(source, extra={DRAFTER_REPO: drafter_src})


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x55
    path.write_bytes(bytes(data))


def test_drafter_fetch_pins_the_hubs_record_then_offline_reverify(source: Path, drafter_src: Path, tmp_path: Path) -> None:
    from drafter.manifest import LOCK_NAME

    dest, report = tmp_path / "GLM-5.3-DFlash2", tmp_path / "r.json"
    with drafter_hub(source, drafter_src) as hub:
        proc = fetch(["--drafter", "--accept-licence", "--dir", str(dest), "--json", str(report)], hub.url, tmp_path / "hf")
        files = hub.repos[DRAFTER_REPO][1]
    assert proc.returncode == 0, proc.stderr
    assert "CC-BY-NC-ND-4.0" in proc.stderr and "may not be redistributed" in proc.stderr
    assert "placeholder" in proc.stderr  # the manifest's revision is not pinned yet, and says so
    for name in ("config.json", "model.safetensors", "LICENSE"):
        assert (dest / name).read_bytes() == (drafter_src / name).read_bytes(), name
    assert not (dest / "training_args.bin").exists()  # outside allow_patterns
    assert not (dest / "glm53-manifest.json").exists()  # the drafter's record is its lock, not the model manifest
    lock = json.loads((dest / LOCK_NAME).read_text())
    assert lock["repository"] == DRAFTER_REPO and lock["revision"] == COMMIT and lock["licence"] == "CC-BY-NC-ND-4.0"
    assert set(lock["files"]) == {"config.json", "model.safetensors", "LICENSE"}
    shard = lock["files"]["model.safetensors"]
    assert shard == {"sha256": files["model.safetensors"]["sha256"], "size": files["model.safetensors"]["size"], "from": "hub"}
    assert lock["files"]["config.json"]["from"] == "hub-git"  # git file: its blob id matched the hub's
    assert lock["files"]["config.json"]["sha256"] == hashlib.sha256((drafter_src / "config.json").read_bytes()).hexdigest()
    doc = json.loads(report.read_text())
    assert doc["status"] == "ok" and doc["drafter_dir"] == str(dest) and doc["source"]["commit"] == COMMIT
    assert f"drafter: {dest}\n" in proc.stdout and f"--drafter {dest}\n" in proc.stdout  # where the engine finds it

    # offline, no hub at all: re-verified against the lock; no licence question (nothing is downloaded)
    proc = fetch(["--drafter", "--offline", "--dir", str(dest)], dead_endpoint(), tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert "verify      ok: 3 files" in proc.stdout and "licence" not in proc.stderr
    # a corrupted file (same size) is caught by the hash, named, exit 1
    flip_last_byte(dest / "model.safetensors")
    proc = fetch(["--drafter", "--offline", "--dir", str(dest), "--json", str(report)], dead_endpoint(), tmp_path / "hf")
    assert proc.returncode == 1
    assert "model.safetensors: sha256 differs from the hub's record" in proc.stderr
    assert json.loads(report.read_text())["status"] == "files"
    # a truncated one by its size
    os.truncate(dest / "config.json", 3)
    proc = fetch(["--drafter", "--offline", "--dir", str(dest)], dead_endpoint(), tmp_path / "hf")
    assert proc.returncode == 1 and "config.json: size 3" in proc.stderr


def test_drafter_refused_without_accepting_the_licence(source: Path, drafter_src: Path, tmp_path: Path) -> None:
    dest, report = tmp_path / "d", tmp_path / "r.json"
    with drafter_hub(source, drafter_src) as hub:
        proc = fetch(["--drafter", "--dir", str(dest), "--json", str(report)], hub.url, tmp_path / "hf")
        assert sum(hub.requests.values()) == 0  # not even the file list was asked for
    assert proc.returncode == 5
    assert "--accept-licence" in proc.stderr and "CC-BY-NC-ND-4.0" in proc.stderr
    assert "https://creativecommons.org/licenses/by-nc-nd/4.0/" in proc.stderr and "Nothing was downloaded" in proc.stderr
    assert not dest.exists()
    assert json.loads(report.read_text())["status"] == "licence_not_accepted"
    # --repo is not the drafter's to choose
    proc = fetch(["--drafter", "--accept-licence", "--repo", "x/y"], dead_endpoint(), tmp_path / "hf")
    assert proc.returncode == 2 and "MANIFEST.json" in proc.stderr


def test_drafter_into_the_cache_then_offline(source: Path, drafter_src: Path, tmp_path: Path) -> None:
    from drafter.manifest import LOCK_NAME

    with drafter_hub(source, drafter_src) as hub:
        proc = fetch(["--drafter", "--accept-licence"], hub.url, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    snapshot = tmp_path / "hf" / "hub" / "models--incoai--GLM-5.3-DFlash2" / "snapshots" / COMMIT
    assert (snapshot / LOCK_NAME).is_file() and f"drafter: {snapshot}\n" in proc.stdout
    proc = fetch(["--drafter", "--offline"], dead_endpoint(), tmp_path / "hf")  # found by repo@main, no --dir
    assert proc.returncode == 0, proc.stderr
    assert f"drafter     {snapshot}\n" in proc.stdout and "verify      ok: 3 files" in proc.stdout


def test_drafter_licence_prompt_on_a_terminal(source: Path, drafter_src: Path, tmp_path: Path) -> None:
    """stdin a real pseudo-terminal: 'n' (or no answer) downloads nothing; 'y' fetches."""
    import pty

    def on_tty(answer: bytes, dest: Path, url: str) -> tuple[int, str]:
        master, slave = pty.openpty()
        try:
            proc = subprocess.Popen(["bash", str(ROOT / "fetch_weights.sh"), "--drafter", "--dir", str(dest)],
                                    stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=hub_env(url, tmp_path / "hf"))
            os.write(master, answer)
            _, err = proc.communicate(timeout=120)
        finally:
            os.close(slave)
            os.close(master)
        return proc.returncode, err

    with drafter_hub(source, drafter_src) as hub:
        code, err = on_tty(b"n\n", tmp_path / "no", hub.url)
        assert code == 5 and "Accept CC-BY-NC-ND-4.0" in err and "nothing was downloaded" in err
        assert not (tmp_path / "no").exists() and sum(hub.requests.values()) == 0
        code, err = on_tty(b"y\n", tmp_path / "yes", hub.url)
        assert code == 0, err
    assert (tmp_path / "yes" / "model.safetensors").read_bytes() == (drafter_src / "model.safetensors").read_bytes()


def test_drafter_served_damaged_is_caught(source: Path, drafter_src: Path, tmp_path: Path) -> None:
    """A mirror serving bytes that differ from its own metadata: the lock keeps the hub's hash, not the
    damaged file's, so the fetch fails (exit 1) and so does every later offline re-verify."""
    from drafter.manifest import LOCK_NAME

    bad, dest = tmp_path / "bad_src", tmp_path / "d"
    shutil.copytree(drafter_src, bad)
    with drafter_hub(source, bad) as hub:  # metadata taken now; then the served shard changes, same size
        want = hub.repos[DRAFTER_REPO][1]["model.safetensors"]["sha256"]
        flip_last_byte(bad / "model.safetensors")
        proc = fetch(["--drafter", "--accept-licence", "--dir", str(dest)], hub.url, tmp_path / "hf")
    assert proc.returncode == 1, proc.stderr
    assert "model.safetensors: sha256 differs from the hub's record" in proc.stderr and "FAILED" in proc.stdout
    assert json.loads((dest / LOCK_NAME).read_text())["files"]["model.safetensors"]["sha256"] == want
    proc = fetch(["--drafter", "--offline", "--dir", str(dest)], dead_endpoint(), tmp_path / "hf")
    assert proc.returncode == 1 and "model.safetensors" in proc.stderr
    # a damaged git (non-LFS) file is refused by its blob id before anything is pinned
    (bad / "config.json").write_text((drafter_src / "config.json").read_text().replace("1", "2", 1))
    shutil.rmtree(dest)
    with drafter_hub(source, drafter_src) as hub:  # metadata of the good config.json ...
        hub.repos[DRAFTER_REPO] = (bad, hub.repos[DRAFTER_REPO][1])  # ... served from the damaged folder
        proc = fetch(["--drafter", "--accept-licence", "--dir", str(dest)], hub.url, tmp_path / "hf")
    assert proc.returncode == 1 and "config.json: content differs from the hub's" in proc.stderr
    assert not (dest / LOCK_NAME).exists()
