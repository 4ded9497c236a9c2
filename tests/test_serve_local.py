"""The embedded default end to end: serve.sh --local runs the real glm53 engine on the tiny
checkpoint under the kit's front; verify.sh checks it; the bad cases stop the lane cleanly."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import pytest

from lane_fixtures import cleanup_lanes, free_port, tiny_dirs, tiny_model, track_port  # noqa: F401  (fixtures)
from lane_fixtures import LANES_DIR as LANES, lane_state, rank_pids, running_lane, wait_for
from lane_fixtures import kill_mid_stream, kill_rank_while_loading
from lane_fixtures import run_kit_script as sh
from launcher.state import pid_alive


@pytest.fixture(scope="module")
def lane(tiny_model: Path):
    with running_lane("--local", "--model", str(tiny_model), "--context", "1024") as (port, started):
        yield port, started


def test_local_lane_is_ready_and_passes_verify(lane) -> None:
    port, started = lane
    assert "preflight: rank 0 (local): ok" in started.stderr
    assert "memory plan: context 1024 tokens" in started.stderr
    assert f"READY: glm-5.3-exl3 on http://127.0.0.1:{port} (1 rank); smoke completion: 8 tokens" in started.stderr
    assert "loading" in started.stderr and "GiB free" in started.stderr  # progress with free memory
    checked = sh("verify.sh", "--url", f"http://127.0.0.1:{port}/v1")  # the base URL OpenAI clients take
    assert checked.returncode == 0, checked.stdout + checked.stderr
    out = checked.stdout
    for name in ("models", "completion", "repeat", "cached", "stream"):
        assert f"PASS     {name}:" in out, out
    # drafted equals serial when the server drafts; when it says it does not, the check says so
    drafting = httpx.get(f"http://127.0.0.1:{port}/health").json()["drafting"]
    assert ('PASS     draft: "draft": false gave the same text' in out) if drafting else \
        ("SKIPPED  draft: the server reports drafting off" in out)


def test_prompt_longer_than_context_is_400_with_limits(lane) -> None:
    port, _ = lane
    words = "The lighthouse keeper counted ships in the harbour. " * 150
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": words}], "max_tokens": 8}, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages" and "context of 1024 tokens" in error["message"]
    assert int(error["message"].split("prompt has ")[1].split()[0]) > 1024


def test_client_disconnect_mid_stream_stops_the_real_engine(lane) -> None:
    port, _ = lane

    def completed() -> int:
        m = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        return int(float(next(line for line in m.splitlines()
                              if line.startswith("glm53_completion_tokens_total ")).split()[1]))

    before = completed()
    body = json.dumps({"messages": [{"role": "user", "content": "count"}], "max_tokens": 900, "ignore_eos": True,
                       "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < 4:
        got += sock.recv(65536)
    sock.close()
    wait_for(lambda: "glm53_cancelled_total 1.0" in httpx.get(f"http://127.0.0.1:{port}/metrics").text, 60,
             "the engine to stop after the disconnect")
    assert completed() - before < 200  # 900 asked
    assert httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"


def test_port_in_use_and_lane_already_running(lane, tiny_model: Path) -> None:
    port, _ = lane
    again = sh("serve.sh", "--local", "--model", str(tiny_model), "--port", str(port))
    assert again.returncode == 5 and f"a lane already serves port {port}" in again.stderr
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = track_port(holder.getsockname()[1])
        r = sh("serve.sh", "--local", "--model", str(tiny_model), "--port", str(busy))
    assert r.returncode == 5, r.stderr
    assert f"port {busy} on 127.0.0.1 is in use" in r.stderr and "--port" in r.stderr


def test_a_context_past_the_model_is_refused_before_anything_starts(tiny_model: Path, capsys) -> None:
    """--context above max_position_embeddings would let the front accept requests the engine then
    refuses, stopping the lane (a 500, then nothing): serve.sh refuses it up front, and a rank
    started by hand refuses it at its arguments."""
    import glm53.serving.rank

    limit = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    port = track_port(free_port())
    r = sh("serve.sh", "--local", "--model", str(tiny_model), "--port", str(port), "--context", str(limit + 1))
    assert r.returncode == 3, r.stderr
    assert f"serve at most --context {limit}" in r.stdout + r.stderr and "starting" not in r.stdout + r.stderr
    with pytest.raises(SystemExit) as exit_info:
        glm53.serving.rank.parse_args(["--model", str(tiny_model), "--context", str(limit + 1)])
    assert exit_info.value.code == 2 and f"holds at most {limit} positions" in capsys.readouterr().err
    assert glm53.serving.rank.parse_args(["--model", str(tiny_model), "--context", str(limit)]).context == limit


def test_rank_killed_during_a_request_stops_the_lane_naming_it(lane) -> None:
    port, _ = lane  # last test of the module: it ends the lane
    pid = rank_pids(port, 1)[0]
    rest = kill_mid_stream(port, pid, max_tokens=900)
    assert "data: [DONE]" not in rest  # the stream broke off
    wait_for(lambda: lane_state(port).get("phase") == "failed", 30, "the lane to stop")
    status = sh("serve.sh", "status", "--port", str(port))
    assert status.returncode == 1
    state = json.loads(status.stdout)
    assert "rank 0 on local exited with code -9 (killed (SIGKILL))" in state["message"]
    assert not pid_alive(state["pid"])
    stopped = sh("serve.sh", "stop", "--port", str(port))
    assert stopped.returncode == 0 and (LANES / str(port) / "rank0.log").stat().st_size > 0  # logs kept


def test_rank_killed_during_load_fails_the_start_with_its_log(tiny_model: Path) -> None:
    proc = kill_rank_while_loading("--local", "--model", str(tiny_model), rank=0, timeout=60)
    err = proc.stderr
    assert proc.returncode == 1, err
    assert "rank 0 on local exited with code -9" in err
    assert "last lines of rank 0's log" in err and "@state" in err


def test_stop_with_nothing_running_is_harmless() -> None:
    r = sh("serve.sh", "stop", "--port", str(free_port()))
    assert r.returncode == 0 and "nothing to stop" in r.stderr


def test_probe_answers_on_a_node_without_git(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bare machine (a GPU host given a copy of the kit, no git installed) still answers preflight:
    no commit, not dirty, instead of the probe failing."""
    from launcher.probe import probe

    monkeypatch.setenv("PATH", str(tmp_path))  # no git on PATH
    answer = probe(str(tiny_model), str(Path(__file__).resolve().parents[1]), None, None)
    assert answer["kit_commit"] is None and answer["kit_dirty"] is False and answer["model_present"]
