"""A real two-rank lane on this machine: the glm53 engine over glm53.dist (gloo), rank 0 under the
kit's front, rank 1 following; verify.sh through both ranks; a follower killed during a request and
during the load stops the lane and is named."""
from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from lane_fixtures import cleanup_lanes, tiny_dirs, tiny_model  # noqa: F401  (fixtures)
from lane_fixtures import kill_mid_stream, kill_rank_while_loading, lane_state, run_kit_script, running_lane, wait_for
from lane_fixtures import rank_pids as pids
from launcher.state import pid_alive


def sh(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_kit_script(*args, timeout=timeout)


def started_at(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


@pytest.fixture(scope="module")
def lane(tiny_model: Path):
    with running_lane("--local", "--ranks", "2", "--model", str(tiny_model), "--context", "2048", timeout=300) as lane:
        yield lane


def test_two_ranks_ready_and_verify_passes(lane) -> None:
    port, up = lane
    assert f"READY: glm-5.3-exl3 on http://127.0.0.1:{port} (2 ranks)" in up.stderr
    assert "rank 1 (local): following" in up.stderr
    rank0, rank1 = pids(port, 2)
    assert started_at(rank1) <= started_at(rank0)  # highest first, rank 0 last
    checked = sh("verify.sh", "--url", f"http://127.0.0.1:{port}")
    assert checked.returncode == 0, checked.stdout
    for name in ("completion", "repeat", "stream"):
        assert f"PASS     {name}:" in checked.stdout
    cached = next(line for line in checked.stdout.splitlines() if " cached:" in line)
    assert cached.startswith("PASS") or "the server reports its prefix cache" in cached  # never a silent pass


def test_restart_with_bad_settings_leaves_the_lane_serving(lane, tmp_path: Path) -> None:
    port, _ = lane
    before = pids(port, 2)
    r = sh("serve.sh", "restart", "--local", "--ranks", "2", "--model", str(tmp_path / "nothing"), "--port", str(port))
    assert r.returncode == 3 and "restart refused" in r.stderr
    assert all(pid_alive(p) for p in before)
    assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).status_code == 200


def test_follower_killed_during_a_request_stops_the_lane_naming_it(lane) -> None:
    port, _ = lane  # ends the module's lane
    rank0, rank1 = pids(port, 2)
    rest = kill_mid_stream(port, rank1, max_tokens=1500)
    assert "data: [DONE]" not in rest
    wait_for(lambda: lane_state(port).get("phase") == "failed", 60, "the lane to stop")
    wait_for(lambda: not pid_alive(rank0), 30, "rank 0 to stop")
    state = lane_state(port)
    assert state["message"].startswith("rank 1 on local exited with code -9"), state["message"]


def test_follower_killed_during_load_fails_the_start_naming_it(tiny_model: Path) -> None:
    proc = kill_rank_while_loading("--local", "--ranks", "2", "--model", str(tiny_model), rank=1, timeout=120)
    err = proc.stderr
    assert proc.returncode == 1, err
    assert "rank 1 on local exited with code -9" in err and "last lines of rank 1's log" in err
