"""The launcher through a real OpenSSH server on loopback: preflight, DRY_RUN, runtime preparation
check, a lane whose ranks start over ssh, and the ssh failures (unreachable node, refused key)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from lane_fixtures import cleanup_lanes, free_port, tiny_dirs, tiny_model, track_port  # noqa: F401  (fixtures)
from launcher.commands import RUNTIME_STAMP, runtime_key
from launcher.state import pid_alive, read_json
from sshd_fixture import Sshd, start_sshd, stop_sshd

ROOT = Path(__file__).resolve().parents[1]
LANES = ROOT / ".work" / "lanes"


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    stop_sshd(server)


def cluster(tmp: Path, sshd: Sshd, model: Path, ranks: int, port: int, **extra) -> Path:
    nodes = [{"host": "127.0.0.1", "rank": r, "user": sshd.user, "ssh_port": sshd.port, "identity": str(sshd.key),
              "fabric": "127.0.0.1"} for r in range(ranks)]
    for r, changes in extra.pop("node_changes", {}).items():
        nodes[r].update(changes)
    body = {"nodes": nodes, "model": str(model), "runtime": {"venv": str(ROOT / ".venv")}, "kit_dir": str(ROOT),
            "port": port, "device": "cpu", "master_port": free_port(), "ssh_options": ["-F", str(sshd.client_config)],
            "memory": {"floor_gib": 1.0, "overhead_gib": 1.0, "workspace_gib": 0.5}, **extra}
    path = tmp / f"cluster-{port}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def sh(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_dry_run_over_ssh_prints_every_command_on_every_node(sshd: Sshd, tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    path = cluster(tmp_path, sshd, tiny_model, 4, port, context=4096)
    r = sh("serve.sh", "--cluster", str(path), env={"DRY_RUN": "1"})
    assert r.returncode == 0, r.stderr
    out = r.stderr
    assert "preflight: 4/4 nodes answered" in out
    for rank in range(4):
        assert f"preflight: rank {rank} (127.0.0.1): ok" in out
        start = next(line for line in out.splitlines() if line.strip().startswith(f"start rank {rank} (127.0.0.1)"))
        assert "ssh -o BatchMode=yes" in start and f"-p {sshd.port}" in start and f"{sshd.user}@127.0.0.1" in start
        assert f"--rank {rank} --ranks 4 --master 127.0.0.1" in start
    assert "start order: rank 3, rank 2, rank 1, rank 0 (rank 0 last)" in out
    assert "memory plan: context 4096 tokens" in out and out.count("  yes") >= 4
    assert "prepare:" in out and RUNTIME_STAMP in out
    assert not (LANES / str(port)).exists()


def test_unreachable_node_and_refused_key_are_named(sshd: Sshd, tiny_model: Path, tmp_path: Path) -> None:
    closed = free_port()
    port = free_port()
    path = cluster(tmp_path, sshd, tiny_model, 3, port,
                   node_changes={1: {"ssh_port": closed}, 2: {"identity": str(sshd.stranger_key)}})
    r = sh("serve.sh", "--cluster", str(path))
    assert r.returncode == 3, r.stderr
    err = r.stderr
    assert f"rank 1 (127.0.0.1): cannot reach {sshd.user}@127.0.0.1:{closed} by ssh" in err
    assert "Fix: check the node is up" in err
    assert f"rank 2 (127.0.0.1): ssh to {sshd.user}@127.0.0.1:{sshd.port} refused the key" in err
    assert "ssh-copy-id" in err
    assert "preflight: rank 0 (127.0.0.1): ok" in err
    assert not (LANES / str(port) / "lane.json").exists()


def test_runtime_preparation_is_keyed_and_checked_on_every_node(sshd: Sshd, tiny_model: Path, tmp_path: Path) -> None:
    # a runtime that is the kit's own venv under another path, with its own stamp
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    for name in ("bin", "lib", "include", "pyvenv.cfg"):
        if (ROOT / ".venv" / name).exists():
            (runtime / name).symlink_to(ROOT / ".venv" / name)
    workdir = tmp_path / "tensorfold"
    subprocess.run(["git", "init", "-q", str(workdir)], check=True)
    subprocess.run(["git", "-C", str(workdir), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "pin"], check=True)
    path = cluster(tmp_path, sshd, tiny_model, 2, free_port(), runtime={"venv": str(runtime)}, workdir=str(workdir))
    (runtime / RUNTIME_STAMP).write_text("an-older-key\n")
    check = sh("serve.sh", "check", "--cluster", str(path))
    assert check.returncode == 3
    for rank in (0, 1):
        assert (f"rank {rank} (127.0.0.1): runtime key an-older-key != {runtime_key()}" in check.stderr
                and f"python -m launcher prepare --cluster {path}" in check.stderr), check.stderr
    (runtime / RUNTIME_STAMP).write_text(runtime_key() + "\n")
    prepared = sh("serve.sh", "prepare", "--cluster", str(path))
    assert prepared.returncode == 0, prepared.stderr
    assert prepared.stderr.count("up-to-date") == 2  # idempotent: nothing reinstalled
    check = sh("serve.sh", "check", "--cluster", str(path))
    assert check.returncode == 0, check.stderr


@pytest.fixture(scope="module")
def ssh_lane(sshd: Sshd, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two real glm53 ranks, each started through sshd (glm53.dist over gloo on loopback)."""
    port = free_port()
    path = cluster(tmp_path_factory.mktemp("lane"), sshd, tiny_model, 2, port, context=2048)
    up = sh("serve.sh", "--cluster", str(path))
    try:
        yield port, path, up
    finally:
        sh("serve.sh", "stop", "--cluster", str(path))


def test_lane_started_over_ssh_serves(ssh_lane) -> None:
    port, _, up = ssh_lane
    assert up.returncode == 0, up.stderr
    assert f"READY: glm-5.3-exl3 on http://127.0.0.1:{port} on 127.0.0.1 (2 ranks)" in up.stderr  # via the tunnel
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_follower_over_ssh_dies_and_the_lane_stops(ssh_lane) -> None:
    port, path, up = ssh_lane  # ends the module's lane
    assert up.returncode == 0, up.stderr
    pids = [int((LANES / str(port) / f"rank{r}.pid").read_text()) for r in (0, 1)]
    os.kill(pids[1], 9)
    deadline = time.monotonic() + 60
    while (read_json(LANES / str(port) / "lane.json") or {}).get("phase") != "failed" and time.monotonic() < deadline:
        time.sleep(0.1)
    state = read_json(LANES / str(port) / "lane.json")
    # ssh exits 255 when the remote command dies of a signal; the supervisor asks the node why
    assert state["phase"] == "failed" and state["message"].startswith(
        "rank 1 on 127.0.0.1 exited with code 255 (ssh reports 255: the rank process is gone"), state["message"]
    deadline = time.monotonic() + 30
    while pid_alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(pids[0])  # rank 0 was stopped (through ssh)
    assert (LANES / str(port) / "rank0.log").read_text().count("@state") >= 2  # logs kept
    stopped = sh("serve.sh", "stop", "--cluster", str(path))
    assert stopped.returncode == 0


def test_remote_rank0_port_in_use_fails_the_start_naming_it(sshd: Sshd, tiny_model: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = track_port(holder.getsockname()[1])
        path = cluster(tmp_path, sshd, tiny_model, 2, port)
        up = sh("serve.sh", "--cluster", str(path), env={"GLM53_RANK_MODULE": "tests.standin_rank"})
    assert up.returncode == 1, up.stderr
    assert "rank 0 on 127.0.0.1 exited with code 98 (its HTTP port is taken)" in up.stderr
    assert f"rank 0: cannot listen on 127.0.0.1:{port}" in up.stderr  # the log tail
    state = read_json(LANES / str(port) / "lane.json")
    assert state["phase"] == "failed" and all(r["exit"] is not None for r in state["ranks"])  # rank 1 stopped too
