"""Launcher behaviour that does not depend on the engine (the memory guard, the memory plan's
refusal, DRY_RUN, restart, stop after the supervisor died), on several local ranks whose engine is
a stand-in (tests/standin_rank.py; everything else, glm53.serving.rank included, is real): a real glm53
engine start costs 15-60 s on this shared machine. The real engine's lanes: test_serve_local.py
(one rank), test_serve_ranks.py (two ranks), test_launcher_ssh.py (over ssh)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import httpx

from lane_fixtures import cleanup_lanes, free_port, tiny_dirs, tiny_model  # noqa: F401  (fixtures)
from lane_fixtures import LANES_DIR as LANES, lane_state, run_kit_script, running_lane, wait_for
from lane_fixtures import rank_pids as pids
from launcher.state import pid_alive

STANDIN = {"GLM53_RANK_MODULE": "tests.standin_rank"}


def sh(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_kit_script(*args, env={**STANDIN, **(env or {})}, timeout=timeout)


def standin_lane(*serve_args: str, env: dict[str, str] | None = None):
    """A lane of stand-in ranks (running_lane with this module's environment and timeout)."""
    return running_lane(*serve_args, env={**STANDIN, **(env or {})}, timeout=120)


def meminfo(path: Path, available_gib: float) -> None:
    kb = int(available_gib * (1 << 20))
    path.write_text(f"MemTotal:       {64 << 20} kB\nMemFree:        {kb} kB\nMemAvailable:   {kb} kB\n")


def test_memory_guard_stops_the_lane_below_the_floor(tiny_model: Path, tmp_path: Path) -> None:
    fake = tmp_path / "meminfo"
    meminfo(fake, 40)
    env = {"TF_GLM53_MEMINFO": str(fake)}
    with standin_lane("--local", "--ranks", "2", "--model", str(tiny_model), env=env) as (port, _):
        all_pids = pids(port, 2)
        meminfo(fake, 1.0)  # under the 2 GiB floor the local CPU lane passes to every rank
        wait_for(lambda: lane_state(port).get("phase") == "failed", 30, "the guard to stop the lane")
        wait_for(lambda: not any(pid_alive(p) for p in all_pids), 30, "every rank to stop")
        state = lane_state(port)
        assert "exited with code 75 (the memory guard stopped it)" in state["message"]
        dead = next(r for r in state["ranks"] if r["exit"] == 75)
        log = Path(dead["log"]).read_text()
        assert f"memory guard: rank {dead['rank']}" in log and "fell below the floor of 2048 MiB" in log


def test_memory_plan_refuses_a_start_and_names_the_largest_context(tiny_model: Path, tmp_path: Path) -> None:
    fake = tmp_path / "meminfo"
    meminfo(fake, 6.0)  # two CPU ranks need 2 x 1.5 GiB + KV; the floor is 4 GiB (2, doubled: unified)
    port = free_port()
    r = sh("serve.sh", "--local", "--ranks", "2", "--model", str(tiny_model), "--port", str(port),
           "--context", "32768", env={"TF_GLM53_MEMINFO": str(fake)})
    assert r.returncode == 4, r.stderr
    assert "memory plan refuses the start: rank 0 on local" in r.stderr
    assert "the weights alone do not fit" in r.stderr or "--context" in r.stderr
    assert not (LANES / str(port) / "lane.json").exists()


def test_dry_run_prints_plan_and_commands_and_changes_nothing(tiny_model: Path) -> None:
    port = free_port()
    r = sh("serve.sh", "--local", "--ranks", "2", "--model", str(tiny_model), "--port", str(port), "--context", "2048",
           env={"DRY_RUN": "1", "TF_GLM53_API_KEYS": "secret-key"})
    assert r.returncode == 0, r.stderr
    out = r.stderr
    assert "secret-key" not in out and "TF_GLM53_API_KEYS=<hidden>" in out  # forwarded, never printed
    assert "memory plan: context 2048 tokens" in out and "DRY_RUN: nothing is started or changed" in out
    assert "start order: rank 1, rank 0 (rank 0 last)" in out
    assert out.index("start rank 1 (local)") < out.index("start rank 0 (local)")
    assert f"--rank 1 --ranks 2" in out and f"--port {port}" in out and "stop rank 0 (local)" in out
    assert not (LANES / str(port)).exists()


def test_restart_checks_new_settings_before_stopping_the_old_lane(tiny_model: Path, tmp_path: Path) -> None:
    """Also: TF_GLM53_API_KEYS reaches rank 0 (the supervisor's smoke completion sends the key), and
    the old lane's orderly stop (rank 0 drains first) lets the restart proceed."""
    key = {"TF_GLM53_API_KEYS": "lane-key"}
    with standin_lane("--local", "--ranks", "2", "--model", str(tiny_model), env=key) as (port, _):
        old = pids(port, 2)
        refused = sh("serve.sh", "restart", "--local", "--ranks", "2", "--model", str(tmp_path / "missing"),
                     "--port", str(port), env=key)
        assert refused.returncode == 3 and "restart refused; the running lane (if any) was left as it was" in refused.stderr
        assert "missing/config.json is missing" in refused.stderr
        assert all(pid_alive(p) for p in old)
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["ranks"] == 2
        again = sh("serve.sh", "restart", "--local", "--ranks", "3", "--model", str(tiny_model), "--port", str(port),
                   env=key)
        assert again.returncode == 0, again.stderr
        assert "stopped on request" in again.stderr and "READY" in again.stderr
        assert not any(pid_alive(p) for p in old)
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["ranks"] == 3
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        assert httpx.post(url, json=chat).status_code == 401
        assert httpx.post(url, json=chat, headers={"x-api-key": "lane-key"}).status_code == 200


def test_stop_after_the_supervisor_was_killed_still_stops_every_rank(tiny_model: Path) -> None:
    with standin_lane("--local", "--ranks", "2", "--model", str(tiny_model)) as (port, _):
        ranks = pids(port, 2)
        supervisor = lane_state(port)["pid"]
        os.kill(supervisor, signal.SIGKILL)
        wait_for(lambda: not pid_alive(supervisor), 10, "the supervisor to die")
        assert all(pid_alive(p) for p in ranks)  # orphaned ranks keep serving...
        stopped = sh("serve.sh", "stop", "--port", str(port))
        assert stopped.returncode == 0 and "no supervisor was running" in stopped.stderr
        wait_for(lambda: not any(pid_alive(p) for p in ranks), 15, "the ranks to stop")  # ...until stop


def test_every_rank_freezes_its_startup_heap_before_it_serves(tiny_model: Path) -> None:
    """glm53.runtime.heap: a rank loaded and about to serve (rank 0) or follow (the others) moves its
    startup heap out of the collector's walk, and says how many objects it froze."""
    with standin_lane("--local", "--ranks", "2", "--model", str(tiny_model)) as (port, _):
        logs = {r["rank"]: Path(r["log"]) for r in lane_state(port)["ranks"]}
        assert sorted(logs) == [0, 1]
        for rank, log in logs.items():
            wait_for(lambda: "frozen out of the garbage collector's walk" in log.read_text(), 30,
                     f"rank {rank} to freeze its heap")
            frozen = re.search(rf"rank {rank}: (\d+) startup objects frozen", log.read_text())
            assert frozen and int(frozen.group(1)) > 10_000, log.read_text()[-2000:]
