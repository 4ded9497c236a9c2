"""A real rank 0 (glm53.serving.rank, stand-in engine: tests/standin_rank.py) stopped by SIGTERM, as the
supervisor stops it: the request in flight finishes, new ones get 503 with Retry-After, the rank
exits 0; and its access log lines carry a timestamp, the request id, the status and the duration."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from lane_fixtures import ROOT, free_port, wait_for, write_tokenizer

CHAT = {"messages": [{"role": "user", "content": "hello"}], "temperature": 0}
ACCESS = re.compile(r'^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} front\.access: 127\.0\.0\.1:\d+ '
                    r'"(GET|POST) (\S+) HTTP/1\.1" (\d{3}) (\d+\.\d)ms id=(\S+)$')


def test_sigterm_drains_then_exits_0(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rank = subprocess.Popen([sys.executable, "-m", "tests.standin_rank", "--model", str(tmp_path), "--port", str(port),
                             "--context", "512", "--progress-interval", "60", "--drain-timeout", "20"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TF_GLM53_MEM_FLOOR_MB": "0"})
    try:
        def serving() -> bool:
            try:
                return rank.poll() is not None or httpx.get(url + "/health").status_code == 200
            except httpx.HTTPError:  # not bound yet
                return False

        wait_for(serving, 30, "rank 0 to serve")
        assert rank.poll() is None, rank.communicate()
        inflight: dict[str, httpx.Response] = {}
        # 150 tokens in bursts of 3 every 20 ms: about a second on the engine
        worker = threading.Thread(target=lambda: inflight.update(r=httpx.post(
            url + "/v1/chat/completions", json={**CHAT, "max_tokens": 150, "ignore_eos": True},
            headers={"x-request-id": "inflight-1"}, timeout=30)))
        worker.start()
        wait_for(lambda: httpx.get(url + "/health").json()["queue_depth"] == 1, 10, "the request to reach the engine")
        rank.send_signal(signal.SIGTERM)
        refused: list[httpx.Response] = []
        wait_for(lambda: refused.append(httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}))
                 or refused[-1].status_code == 503, 5, "new requests to be refused")
        late = refused[-1]
        assert late.headers["retry-after"] == "5" and late.json()["error"]["code"] == "draining"
        assert httpx.get(url + "/health").json()["status"] == "draining"
        worker.join(timeout=30)
        assert inflight["r"].status_code == 200 and inflight["r"].json()["usage"]["completion_tokens"] == 150
        assert rank.wait(timeout=20) == 0
    finally:
        if rank.poll() is None:
            rank.kill()
        out, err = rank.communicate()
    assert '"state": "draining"' in out and '"state": "stopped"' in out, out
    lines = [m.groups() for m in map(ACCESS.match, err.splitlines()) if m]
    assert ("POST", "/v1/chat/completions", "200") in [line[:3] for line in lines], err
    finished = next(line for line in lines if line[4] == "inflight-1")
    assert finished[2] == "200" and float(finished[3]) > 500  # the client's own request id, its duration in ms
    assert any(line[2] == "503" and re.fullmatch(r"[0-9a-f]{32}", line[4]) for line in lines)
