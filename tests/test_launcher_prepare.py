"""Runtime preparation (`python -m launcher prepare`) through real OpenSSH servers on loopback.

venv: a fresh venv on a node, the kit and a stand-in patched checkout installed for real with pip
(PyPI is reached for setuptools, as on a node), keyed, and left alone on a second run.
image: no docker engine runs here, so each node's `docker` is a stand-in executable (first on the
PATH that node's sshd gives its sessions) that logs its argv and keeps that node's images in its own
state file; ssh, tar, the shell commands and the save | load pipe between nodes are real.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launcher import image
from launcher.commands import RUNTIME_STAMP, runtime_key
from launcher.config import ConfigError, load_cluster
from sshd_fixture import SSHD, Sshd, start_sshd, stop_sshd

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "glm53-kit:test"
BASE = "nvcr.io/nvidia/pytorch:25.10-py3"

DOCKER_STANDIN = r'''#!/usr/bin/python3
"""Stand-in docker client: logs argv; images (labels, Dockerfile, context listing) in a JSON file."""
import json, os, pathlib, re, sys

state_path = pathlib.Path(os.environ["DOCKER_STANDIN_STATE"])
args = sys.argv[1:]
with open(str(state_path) + ".log", "a") as log:
    log.write(json.dumps(args) + "\n")
state = json.loads(state_path.read_text()) if state_path.exists() else {}


def save():
    tmp = state_path.with_name(state_path.name + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, state_path)


if args[:2] == ["image", "inspect"]:
    name, fmt = args[-1], args[args.index("--format") + 1]
    if name not in state:
        sys.exit(print(f"Error: No such image: {name}", file=sys.stderr) or 1)
    label = re.fullmatch(r'\{\{index \.Config\.Labels "([^"]+)"\}\}', fmt).group(1)
    print(state[name]["labels"].get(label, "<no value>"))
elif args[0] == "build":
    tag, ctx = args[args.index("-t") + 1], pathlib.Path(args[-1])
    text = (ctx / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (\S+) ", text, re.M):
        if not (ctx / src).is_dir():
            sys.exit(print(f"COPY failed: {src} not in the build context", file=sys.stderr) or 1)
    state[tag] = {"labels": dict(re.findall(r'^LABEL (\S+?)="([^"]*)"', text, re.M)), "dockerfile": text,
                  "context": sorted(str(p.relative_to(ctx)) for p in ctx.rglob("*") if p.is_file())}
    save()
    print(f"Successfully tagged {tag}")
elif args[0] == "save":
    sys.stdout.write(json.dumps({args[1]: state[args[1]]}))
elif args[0] == "load":
    images = json.loads(sys.stdin.read())
    if os.path.exists(str(state_path) + ".full"):
        sys.exit(print("Error processing tar file(exit status 1): write /var/lib/docker/tmp: no space left on device",
                       file=sys.stderr) or 1)
    state.update(images)
    save()
    print("".join(f"Loaded image: {n}\n" for n in images), end="")
else:
    sys.exit(print(f"docker stand-in: unsupported {args}", file=sys.stderr) or 2)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    stop_sshd(server)


class DockerNode:
    """One more sshd on loopback sharing the fixture's keys, whose sessions find the stand-in docker
    first on PATH and keep their images in their own state file (so two nodes do not share images)."""

    def __init__(self, server: Sshd, tmp: Path, name: str, bin_dir: Path) -> None:
        keys = server.client_config.parent
        self.state = tmp / f"{name}-images.json"
        self.port = free_port()
        config = tmp / f"{name}_sshd_config"
        lines = [line for line in (keys / "sshd_config").read_text().splitlines()
                 if not line.startswith(("Port ", "PidFile "))]
        config.write_text("\n".join([f"Port {self.port}", f"PidFile {tmp / name}.pid", *lines,
                                     f"SetEnv PATH={bin_dir}:/usr/local/bin:/usr/bin:/bin "
                                     f"DOCKER_STANDIN_STATE={self.state}"]) + "\n")
        kind, pub = (keys / "host_key.pub").read_text().split()[:2]
        with open(keys / "known_hosts", "a") as f:
            f.write(f"[127.0.0.1]:{self.port} {kind} {pub}\n")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                                     stderr=open(tmp / f"{name}-sshd.log", "w"))
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((tmp / f"{name}-sshd.log").read_text())
                time.sleep(0.05)

    def images(self) -> dict:
        return json.loads(self.state.read_text()) if self.state.exists() else {}

    def calls(self) -> list[list[str]]:
        log = Path(str(self.state) + ".log")
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def docker_nodes(sshd: Sshd, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("docker-nodes")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(DOCKER_STANDIN)
    (bin_dir / "docker").chmod(0o755)
    nodes = [DockerNode(sshd, tmp, f"node{r}", bin_dir) for r in range(2)]
    yield nodes
    for node in nodes:
        node.stop()


def image_cluster(tmp: Path, sshd: Sshd, nodes: list[DockerNode]) -> Path:
    """A kit checkout (with the things the build context must leave out) and a patched checkout."""
    kit, workdir = tmp / "kit", tmp / "tensorfold"
    for d in (kit / ".git", kit / ".venv" / "bin", kit / ".work" / "lanes", kit / "launcher", workdir / ".git",
              workdir / "tensorfold"):
        d.mkdir(parents=True)
    (kit / "pyproject.toml").write_text('[project]\nname = "glm53-kit"\n')
    (kit / "launcher" / "__init__.py").write_text("")
    (kit / ".venv" / "bin" / "python").write_text("not for the image")
    (workdir / "pyproject.toml").write_text('[project]\nname = "tensorfold"\n')
    (workdir / "tensorfold" / "__init__.py").write_text("PATCHED = True\n")
    (workdir / "tensorfold" / "build").mkdir()  # a package named build deeper down is kept
    (workdir / "tensorfold" / "build" / "__init__.py").write_text("")
    (kit / "build").mkdir()  # the kit's own build/ (apply.py's output) is not
    (kit / "build" / "big.bin").write_text("x")
    body = {"nodes": [{"host": "127.0.0.1", "rank": r, "user": sshd.user, "ssh_port": n.port,
                       "identity": str(sshd.key)} for r, n in enumerate(nodes)],
            "model": "/data/models/unused", "runtime": {"image": IMAGE, "base": BASE}, "kit_dir": str(kit),
            "workdir": str(workdir), "device": "cpu", "ssh_options": ["-F", str(sshd.client_config)]}
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def prepare(path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", "prepare", "--cluster", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, **env})


def test_dockerfile_keeps_the_base_torch_and_carries_the_key() -> None:
    text = image.dockerfile(BASE, "k123")
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert body[0] == f"FROM {BASE}"
    assert f"COPY tensorfold {image.IMAGE_TENSORFOLD}" in body and f"COPY kit {image.IMAGE_KIT}" in body
    install = next(line for line in body if line.startswith("RUN "))
    assert "--no-deps" in install and install.endswith(f"{image.IMAGE_TENSORFOLD} {image.IMAGE_KIT}")
    assert body[-1] == 'LABEL glm53.runtime-key="k123"'
    assert "tensorfold" not in image.dockerfile(BASE, "k", with_tensorfold=False)


def test_runtime_base_is_read_and_checked(tmp_path: Path) -> None:
    def load(runtime: dict):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({"nodes": [{"host": "h", "rank": 0}], "model": "/m", "runtime": runtime}))
        return load_cluster(path)

    assert load({"image": IMAGE, "base": BASE}).runtime.base == BASE
    assert image.base_image(load({"image": IMAGE})) == image.DEFAULT_BASE_IMAGE
    with pytest.raises(ConfigError, match=r"c\.yaml: runtime\.base .* goes with runtime\.image"):
        load({"venv": "/v", "base": BASE})
    with pytest.raises(ConfigError, match=r"c\.yaml: runtime\.python is not a runtime field"):
        load({"image": IMAGE, "python": "3"})


def test_image_dry_run_prints_every_command_and_changes_nothing(sshd: Sshd, docker_nodes, tmp_path: Path) -> None:
    path = image_cluster(tmp_path, sshd, docker_nodes)
    before = [n.images() for n in docker_nodes]
    r = prepare(path, DRY_RUN="1")
    assert r.returncode == 0, r.stderr
    key = runtime_key()
    for rank, node in enumerate(docker_nodes):
        inspect = next(line for line in r.stderr.splitlines() if line.startswith(f"rank {rank} (127.0.0.1): inspect: "))
        assert f"-p {node.port}" in inspect and f"docker image inspect --format" in inspect and IMAGE in inspect
    build = next(line for line in r.stderr.splitlines() if line.startswith("rank 0 (127.0.0.1): build"))
    assert f"docker build -t {IMAGE}" in build and f"FROM {BASE}" in build and key in build
    send = next(line for line in r.stderr.splitlines() if line.startswith("rank 1 (127.0.0.1): send"))
    assert f"-p {docker_nodes[0].port}" in send and f"-- 'docker save {IMAGE}' | ssh " in send
    assert f"-p {docker_nodes[1].port}" in send and send.endswith("-- 'docker load'")
    assert [n.images() for n in docker_nodes] == before and all(n.calls() == [] for n in docker_nodes)
    assert not (tmp_path / "kit" / ".work" / "image-build").exists()


def test_image_prepare_builds_on_rank0_sends_it_and_then_does_nothing(sshd: Sshd, docker_nodes, tmp_path: Path) -> None:
    node0, node1 = docker_nodes
    node1.state.write_text(json.dumps({IMAGE: {"labels": {image.KEY_LABEL: "old-key"}}}))
    path = image_cluster(tmp_path, sshd, docker_nodes)
    key = runtime_key()
    seen = [len(n.calls()) for n in docker_nodes]

    r = prepare(path)
    assert r.returncode == 0, r.stderr
    assert f"rank 1 (127.0.0.1): image {IMAGE} carries runtime key old-key, want {key}" in r.stderr
    assert f"rank 0 (127.0.0.1): image {IMAGE} absent or without a runtime key" in r.stderr
    built = node0.images()[IMAGE]
    assert built["labels"] == {image.KEY_LABEL: key}
    assert built["dockerfile"] == image.dockerfile(BASE, key)
    context = built["context"]
    assert {"Dockerfile", "kit/pyproject.toml", "kit/launcher/__init__.py", "tensorfold/tensorfold/__init__.py",
            "tensorfold/pyproject.toml", "tensorfold/tensorfold/build/__init__.py"} <= set(context)
    assert not [f for f in context if "/" in f and f.split("/")[1] in (".git", ".venv", ".work", "build")], context
    assert not (tmp_path / "kit" / ".work" / "image-build" / key).exists()  # the staged context is removed
    assert node1.images()[IMAGE] == built  # rank 0's image, through save | load
    calls = [[c[0] for c in n.calls()[s:]] for n, s in zip(docker_nodes, seen)]
    assert calls == [["image", "build", "image", "save", "image"], ["image", "image", "load", "image"]]
    assert f"prepare: every node carries {IMAGE} with key {key}" in r.stderr

    again = prepare(path)
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("up-to-date") == 2
    assert [[c[0] for c in n.calls()[s + len(c):]] for n, s, c in zip(docker_nodes, seen, calls)] == [["image"]] * 2


def test_image_prepare_names_a_node_where_docker_fails(sshd: Sshd, docker_nodes, tmp_path: Path) -> None:
    node1 = docker_nodes[1]
    node1.state.write_text("{not json")  # the stand-in docker crashes there, as a broken engine would
    try:
        r = prepare(image_cluster(tmp_path, sshd, docker_nodes))
    finally:
        node1.state.unlink()
    assert r.returncode == 3
    assert f"rank 1 (127.0.0.1): docker image inspect {IMAGE} failed (exit 1)" in r.stderr
    assert "Fix: install docker on that node" in r.stderr
    assert "building" not in r.stderr  # nothing is built while a node's answer is unknown


def test_image_prepare_names_the_node_a_transfer_fails_on(sshd: Sshd, docker_nodes, tmp_path: Path) -> None:
    node0, node1 = docker_nodes
    key = runtime_key()
    node0.state.write_text(json.dumps({IMAGE: {"labels": {image.KEY_LABEL: key}}}))
    node1.state.write_text("{}")
    full = Path(str(node1.state) + ".full")
    full.touch()
    seen = len(node0.calls())
    try:
        r = prepare(image_cluster(tmp_path, sshd, docker_nodes))
    finally:
        full.unlink()
    assert r.returncode == 3, r.stderr
    assert (f"rank 1 (127.0.0.1): docker load failed (exit 1): Error processing tar file(exit status 1): "
            f"write /var/lib/docker/tmp: no space left on device") in r.stderr
    assert [c[0] for c in node0.calls()[seen:]] == ["image", "save"]  # rank 0 had the key: no build
    assert node1.images() == {}


def test_venv_prepare_installs_for_real_over_ssh_and_is_idempotent(sshd: Sshd, tmp_path: Path) -> None:
    kit, workdir, venv = tmp_path / "kit", tmp_path / "tensorfold", tmp_path / "runtime"
    kit.mkdir()
    # the kit's own tracked sources (not the shared tree itself: an editable install writes egg-info)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD", "pyproject.toml", "apply.py", "launcher",
                              "glm53"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(kit)], input=archive, check=True)
    (workdir / "tensorfold").mkdir(parents=True)
    (workdir / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "tensorfold"\nversion = "0.6.0+glm53"\n'
        '[tool.setuptools.packages.find]\ninclude = ["tensorfold*"]\n')
    (workdir / "tensorfold" / "__init__.py").write_text("PATCHED = 'glm53 series'\n")
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "nodes": [{"host": "127.0.0.1", "rank": 0, "user": sshd.user, "ssh_port": sshd.port,
                   "identity": str(sshd.key)}],
        "model": "/data/models/unused", "runtime": {"venv": str(venv)}, "kit_dir": str(kit),
        "workdir": str(workdir), "device": "cpu", "ssh_options": ["-F", str(sshd.client_config)]}))

    dry = prepare(path, DRY_RUN="1")
    assert dry.returncode == 0, dry.stderr
    assert f"-p {sshd.port}" in dry.stderr and "--system-site-packages" in dry.stderr and str(workdir) in dry.stderr
    assert not venv.exists()

    r = prepare(path)
    assert r.returncode == 0, r.stderr
    key = runtime_key()
    assert f"rank 0 (127.0.0.1): prepared (key {key})" in r.stderr
    assert (venv / RUNTIME_STAMP).read_text().strip() == key
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import importlib.util, tensorfold; print(tensorfold.PATCHED); print(tensorfold.__file__); "
                            # found, not imported: --no-deps leaves the kit's dependencies to the node
                            "print(importlib.util.find_spec('launcher.image').origin)"],
                           capture_output=True, text=True, cwd="/", check=True).stdout.splitlines()
    assert where == ["glm53 series", str(workdir / "tensorfold" / "__init__.py"),
                     str(kit / "launcher" / "image.py")]
    shown = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json", "--local"],
                           capture_output=True, text=True, check=True).stdout
    assert {"glm53-kit", "tensorfold"} <= {p["name"] for p in json.loads(shown)}
    stamp_mtime = (venv / RUNTIME_STAMP).stat().st_mtime_ns

    again = prepare(path)
    assert again.returncode == 0, again.stderr
    assert f"rank 0 (127.0.0.1): up-to-date (key {key})" in again.stderr
    assert (venv / RUNTIME_STAMP).stat().st_mtime_ns == stamp_mtime
