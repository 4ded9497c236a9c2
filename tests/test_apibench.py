"""glm53-bench (apibench) end to end, with the real openai client against real servers: the kit's
front over the real glm53 engine on the tiny checkpoint (one with its prefix cache on, one with it
off, in this process), a stand-in lane that is killed mid-run, nothing at all, and a server that
answers badly. The tiny model's text is noise: only the shape of the results is checked. Sizes are
tiny so the module stays within seconds."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from click.testing import CliRunner, Result

pytest.importorskip("openai", reason="the bench extra is not installed (pip install -e '.[bench]')")

from glm53.apibench.cli import main  # noqa: E402
from glm53.apibench.endpoint import api_base  # noqa: E402
from glm53.apibench.schema import Report  # noqa: E402
from glm53.apibench.texts import DECODE_KINDS, agent_system, agent_turns, decode_prompt, tool_output  # noqa: E402
from lane_fixtures import ROOT, free_port, tiny_dirs, tiny_model, wait_for, write_tokenizer  # noqa: E402,F401

if TYPE_CHECKING:
    from glm53.serving.front.server import FrontServer

# every size as small as still shows the suite's point (reuse in turn 2, two clients at once)
TINY = ["--samples", "2", "--decode-kinds", "prose", "--decode-tokens", "3", "--ignore-eos", "--agent-turns", "2",
        "--agent-turn-tokens", "120", "--agent-reply-tokens", "2", "--agent-samples", "1", "--extend-tokens", "200",
        "--extend-reply-tokens", "1", "--extend-samples", "1", "--concurrency", "1,2", "--concurrency-tokens", "2",
        "--concurrency-rounds", "1", "--timeout", "60"]


def _front(model: Path, cache: bool) -> FrontServer:
    import glm53
    from glm53.serving.front.chat import ChatText
    from glm53.serving.rank import glm53_sampling
    from glm53.serving.front.server import serve
    from glm53.serving.front.service import Service
    from glm53.serving.front.settings import FrontSettings, drafting_state, prefix_cache_state
    from glm53.settings import Settings
    from kv_cache.engine_adapter import attach_prefix_cache

    engine = glm53.cuda_engine(str(model))
    if not cache:
        attach_prefix_cache(engine, settings=Settings.from_env({"TF_GLM53_PREFIX_CACHE": "0"}))
    settings = FrontSettings(context=1024, default_max_tokens=16, prefix_cache=prefix_cache_state(engine),
                             drafting=drafting_state(engine), prefill_chunk=engine.chunk)
    return serve(Service(engine, ChatText(model), settings, glm53_sampling), "127.0.0.1", 0)


@pytest.fixture(scope="module")
def lanes(tiny_model: Path) -> Iterator[tuple[str, str]]:  # noqa: F811
    """(cache-on URL, cache-off URL): the kit's front over the tiny glm53 engine, in this process."""
    servers = [_front(tiny_model, cache=True), _front(tiny_model, cache=False)]
    yield tuple(s.url for s in servers)  # type: ignore[misc]
    for s in servers:
        s.shutdown()
        assert s.state.service is not None
        s.state.service.close()


def bench(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def report(path: Path) -> Report:
    return Report.model_validate_json(path.read_text())


def test_shipped_texts() -> None:
    assert all(len(decode_prompt(kind)) > 200 for kind in DECODE_KINDS)
    assert len(agent_turns()) == 6 and "tools" in agent_system()
    assert tool_output("s", 5000) == tool_output("s", 5000) != tool_output("t", 5000)
    assert 5000 <= len(tool_output("s", 5000)) < 5200


def test_api_base_takes_the_url_with_or_without_v1() -> None:
    assert api_base("http://h:1") == api_base("http://h:1/v1/") == "http://h:1/v1"
    with pytest.raises(ValueError):
        api_base("h:1")


def test_every_suite_against_the_embedded_engine(lanes, tmp_path: Path) -> None:
    on, off = lanes
    out = tmp_path / "api.json"
    run = bench("--url", on + "/v1", "--no-cache-url", off, "--out", str(out), "--label", "tiny", *TINY)
    assert run.exit_code == 0, run.output
    r = report(out)  # the schema, strictly (no unknown fields)
    assert r.complete and r.failure is None and r.server.model == "glm-5.3-exl3"
    assert r.server.health["prefix_cache"] == "on" and r.no_cache_server.health["prefix_cache"] == "off"
    decode = r.suites.decode
    assert decode.warmup_requests == 2 and r.suites.agent.warmup_requests == 0  # one warm-up a run, the draft probe
    assert decode.draft_field.accepted and {c.mode for c in decode.cases} == {"default", "draft_false"}
    assert len(decode.samples) == 2 * 2 and all(s.completion_tokens == 3 for s in decode.samples)  # from usage
    assert all(c.decode_tok_s.n == 2 and c.ttft_s.median > 0 for c in decode.cases)
    agent = r.suites.agent
    assert agent.cache_off.mode == "url" and [t.turn for t in agent.turns] == [1, 2]
    second = agent.turns[1]
    assert second.cached_on.median >= agent.turns[0].prompt_tokens.median  # turn 1 reused whole
    assert second.cached_off.median == 0 and second.speedup > 0
    extend = r.suites.extend
    assert extend.extended.cached_tokens.median >= extend.cold.prompt_tokens.median - 2
    assert extend.cold.cached_tokens.median < extend.extended.cached_tokens.median
    levels = r.suites.concurrency.levels
    assert [lv.clients for lv in levels] == [1, 2] and len(r.suites.concurrency.streams) == 3
    assert all(lv.aggregate_tok_s.median > 0 and lv.ttft_s.p99 >= lv.ttft_s.p50 for lv in levels)
    for name in ("agent", "concurrency"):
        png = tmp_path / r.plots[name]
        assert png.name == f"api_{name}.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 5000
    text = (tmp_path / "api.txt").read_text()
    assert all(title in text for title in ("decode", "agent", "extend", "concurrency")) and "speedup" in text
    (tmp_path / "api_agent.png").unlink()
    shown = bench("--show", str(out))  # a saved run's tables and plots, no server
    assert shown.exit_code == 0 and "speedup" in shown.output and (tmp_path / "api_agent.png").stat().st_size > 5000


@pytest.fixture(scope="module")
def standin_lane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen]]:
    """A rank process with the stand-in engine (tests/standin_rank.py): the kit's real front, quick
    tokens, cached tokens as the longest prefix shared with an earlier prompt. The last test kills it."""
    tok = tmp_path_factory.mktemp("tok")
    write_tokenizer(tok)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.standin_rank", "--model", str(tok),
                             "--port", str(port), "--context", "4096"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 30, "the stand-in lane")
        yield url, proc
    finally:
        proc.kill()
        proc.wait()


def test_agent_cache_off_by_salt_or_by_a_body_switch(standin_lane, tmp_path: Path) -> None:
    url, _ = standin_lane
    salted, switched = tmp_path / "salt.json", tmp_path / "body.json"
    for out, extra in ((salted, []), (switched, ["--no-cache-body", '{"prefix_cache": false}'])):
        run = bench("--url", url, "--suites", "agent", "--out", str(out), *TINY, *extra)
        assert run.exit_code == 0, run.output
    r = report(salted)
    agent = r.suites.agent
    assert agent.cache_off.mode == "salt" and r.no_cache_server is None and r.plots["agent"] == "salt_agent.png"
    turn2 = agent.turns[1]
    assert turn2.cached_off.median < 16 < turn2.cached_on.median  # only the template's opening matches
    body = report(switched).suites.agent.cache_off  # the stand-in ignores the field: only the record is checked
    assert body.mode == "body" and body.body == {"prefix_cache": False}


def test_a_server_that_dies_mid_run_keeps_the_suites_measured(standin_lane, tmp_path: Path) -> None:
    url, proc = standin_lane
    out = tmp_path / "dies.json"

    def kill_after_decode() -> None:
        def decoded() -> bool:
            try:
                return json.loads(out.read_text())["suites"]["decode"] is not None
            except (OSError, ValueError, KeyError):
                return False
        wait_for(decoded, 60, "the decode suite's JSON")
        os.kill(proc.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_after_decode, daemon=True)
    killer.start()
    # the agent suite takes seconds on the stand-in (90-token replies): the kill lands inside it
    run = bench("--url", url, "--out", str(out), "--suites", "decode,agent", "--samples", "1", "--decode-kinds",
                "prose", "--decode-tokens", "4", "--agent-turn-tokens", "100", "--agent-reply-tokens", "90",
                "--timeout", "30")
    killer.join(5)
    assert run.exit_code == 1, run.output
    assert f"suite agent failed: no answer from {url}/v1" in run.output and str(out) in run.output
    r = report(out)
    assert not r.complete and r.failure.suite == "agent" and url in r.failure.error
    assert r.suites.decode is not None and r.suites.agent is None


def test_nothing_at_the_url_exits_3_naming_it(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "glm53.apibench", "--url", url, "--out", str(tmp_path / "x.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert f"no answer from {url}/v1 to GET /v1/models" in done.stderr and time.monotonic() - started < 30
    assert not (tmp_path / "x.json").exists()
    assert bench("--url", "localhost:8300").exit_code == 2  # not a URL: a usage error
    assert bench("--no-cache-url", url, "--no-cache-body", "{}").exit_code == 2


class _Bad(BaseHTTPRequestHandler):
    """/v1/models as the API defines it (or not, in mode "models"); chat completions wrong per mode."""
    mode = "status"

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        data = "nonsense" if self.mode == "models" else [{"id": "m", "object": "model", "created": 0, "owned_by": "t"}]
        self._send(200 if self.path == "/v1/models" else 404, json.dumps({"object": "list", "data": data}).encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
        bodies = {"status": (500, b'{"error": {"message": "engine fell over"}}', "application/json"),
                  "no_usage": (200, f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(), "text/event-stream"),
                  "garbage": (200, b"data: {not json\n\ndata: [DONE]\n\n", "text/event-stream")}
        self._send(*bodies[self.mode])


@pytest.mark.parametrize("mode, code, said", [
    ("models", 3, "answered GET /v1/models badly"),
    ("status", 1, "answered the warm-up request with HTTP 500: {\"error\": {\"message\": \"engine fell over\""),
    ("no_usage", 1, "sent no usage for the warm-up request"),
    ("garbage", 1, "answered the warm-up request badly"),
])
def test_a_server_that_answers_badly_is_named(mode: str, code: int, said: str, tmp_path: Path) -> None:
    handler = type("Bad", (_Bad,), {"mode": mode})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        run = bench("--url", url, "--out", str(tmp_path / "bad.json"), "--suites", "decode", "--timeout", "10")
    finally:
        server.shutdown()
        server.server_close()
    assert run.exit_code == code, run.output
    assert f"{url}/v1 {said}" in run.output or (f"{url}/v1" in run.output and said in run.output), run.output
    if code == 1:  # the run had started: its JSON names the failure
        r = report(tmp_path / "bad.json")
        assert r.failure.suite == "decode" and said in r.failure.error and r.suites.decode is None
