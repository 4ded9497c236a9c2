"""The front's own HTTP behaviour, on a real server on loopback.

The engine here is a stand-in (tests/lane_fixtures.StandInEngine): these tests exercise the
front (validation, queueing, SSE, disconnects, errors, metrics), not the model. The same front over
the real glm53 engine on the tiny checkpoint is tested in tests/test_lane_local.py.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from front.chat import ChatText
from front.server import App, FrontServer, FrontSettings, make_server
from lane_fixtures import StandInEngine, write_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return d


def start(model_dir: Path, engine: StandInEngine, context: int = 256):
    text = ChatText(model_dir)
    app = App(engine, text, FrontSettings(context=context, default_max_tokens=16), dict)
    server = make_server(app, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", app


@pytest.fixture
def lane(model_dir: Path):
    text = ChatText(model_dir)
    engine = StandInEngine(vocab=text.tokenizer.get_vocab_size(), eos=text.tokenizer.token_to_id("<|endoftext|>"))
    server, url, app = start(model_dir, engine)
    yield url, engine, app
    server.shutdown()
    server.server_close()


CHAT = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 10, "temperature": 0}


def sse_text(response: httpx.Response) -> tuple[str, list[dict]]:
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, chunks


def test_chat_completion_has_content_finish_reason_and_usage(lane) -> None:
    url, engine, _ = lane
    r = httpx.post(url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["model"] == "glm-5.3-exl3"
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 10
    assert usage["prompt_tokens"] == len(engine.calls[0]["prompt"])
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    # the prompt is the chat template rendered and encoded (GLM specials as single tokens)
    assert engine.calls[0]["prompt"][:2] == [1, 2]  # [gMASK] <sop>


def test_resend_reports_cached_tokens_and_stop_at_eos(model_dir: Path) -> None:
    text = ChatText(model_dir)
    eos = text.tokenizer.token_to_id("<|endoftext|>")
    engine = StandInEngine(vocab=text.tokenizer.get_vocab_size(), eos=eos, stop_after=4)
    server, url, _ = start(model_dir, engine)
    try:
        first = httpx.post(url + "/v1/chat/completions", json=CHAT).json()
        assert first["choices"][0]["finish_reason"] == "stop"
        assert first["usage"]["completion_tokens"] == 5  # 4 tokens + eos
        longer = {**CHAT, "messages": CHAT["messages"] + [{"role": "assistant", "content": "fine"},
                                                         {"role": "user", "content": "and you?"}]}
        second = httpx.post(url + "/v1/chat/completions", json=longer).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        ignore = httpx.post(url + "/v1/chat/completions", json={**CHAT, "ignore_eos": True}).json()
        assert ignore["choices"][0]["finish_reason"] == "length"
        assert ignore["usage"]["completion_tokens"] == 10
    finally:
        server.shutdown()
        server.server_close()


def test_stream_delivers_the_same_text_and_usage(lane) -> None:
    url, _, _ = lane
    plain = httpx.post(url + "/v1/chat/completions", json=CHAT).json()
    r = httpx.post(url + "/v1/chat/completions",
                   json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    text, chunks = sse_text(r)
    assert text == plain["choices"][0]["message"]["content"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["length"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"] == 10
    assert usage["prompt_tokens_details"]["cached_tokens"] == plain["usage"]["prompt_tokens"]  # resend


def test_completions_route_with_text_and_token_prompts(lane) -> None:
    url, engine, _ = lane
    a = httpx.post(url + "/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 5}).json()
    assert a["object"] == "text_completion" and a["usage"]["completion_tokens"] == 5 and a["choices"][0]["text"]
    ids = engine.calls[-1]["prompt"]
    b = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 5}).json()
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    bad = httpx.post(url + "/v1/completions", json={"prompt": [10**7], "max_tokens": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_sampling_fields_reach_the_engine(lane) -> None:
    url, engine, _ = lane
    body = {**CHAT, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 123,
            "draft": False, "ignore_eos": True, "max_tokens": None, "max_completion_tokens": 7}
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert engine.calls[-1]["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                            "seed": 123, "draft": False, "ignore_eos": True}
    assert engine.calls[-1]["max_tokens"] == 7
    seeded = [httpx.post(url + "/v1/chat/completions", json={**CHAT, "seed": s}).json() for s in (1, 1, 2)]
    texts = [s["choices"][0]["message"]["content"] for s in seeded]
    assert texts[0] == texts[1] != texts[2]


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "top_p": 1.5}, "top_p"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({**CHAT, "draft": "no"}, "draft"),
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "stop": ["\n"]}, "stop"),
])
def test_bad_requests_get_400_naming_the_field(lane, body, param) -> None:
    url, engine, _ = lane
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split("[")[0].split(".")[0] in err["message"]
    assert engine.calls == []


def test_untokenizable_text_and_clashing_template_arguments_are_400(lane) -> None:
    """A lone surrogate (valid JSON escape, not valid Unicode) and chat_template_kwargs naming an
    argument the front passes itself made the handler raise: the client got no response."""
    url, engine, _ = lane
    for path, body, param in (
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udcff"}]}', "messages"),
            ("/v1/completions", b'{"prompt": "\\udcff b", "max_tokens": 2}', "prompt")):
        r = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and "valid Unicode" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    assert engine.calls == []
    assert httpx.post(url + "/v1/chat/completions", json=CHAT).status_code == 200  # still serving


def test_invalid_json_and_unknown_model(lane) -> None:
    url, _, _ = lane
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "model": "gpt-4"})
    assert r.status_code == 404 and "glm-5.3-exl3" in r.json()["error"]["message"]


def test_prompt_longer_than_context_is_400_with_the_limits(lane) -> None:
    url, engine, _ = lane
    long = {"messages": [{"role": "user", "content": "the quick brown fox " * 200}], "max_tokens": 10}
    r = httpx.post(url + "/v1/chat/completions", json=long)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    n_prompt = int(msg.split("prompt has ")[1].split()[0])
    assert n_prompt > 256 and "max_tokens is 10" in msg and "context of 256 tokens" in msg
    # fits alone, but not with the requested completion
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 250})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "at most" in r.json()["error"]["message"]
    assert engine.calls == []


def test_models_health_metrics(lane) -> None:
    url, _, _ = lane
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["glm-5.3-exl3"]
    for path in ("/health", "/v1/health"):
        h = httpx.get(url + path)
        assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["prefix_cache"] == "absent"
    httpx.post(url + "/v1/chat/completions", json=CHAT)
    httpx.post(url + "/v1/chat/completions", json={"messages": []})
    m = httpx.get(url + "/metrics").text
    assert 'glm53_requests_total{route="/v1/chat/completions",status="200"} 1' in m
    assert 'glm53_requests_total{route="/v1/chat/completions",status="400"} 1' in m
    assert "glm53_completion_tokens_total 10" in m and "glm53_errors_total 1" in m


def test_requests_are_serialized_on_the_engine(model_dir: Path) -> None:
    text = ChatText(model_dir)
    engine = StandInEngine(vocab=text.tokenizer.get_vocab_size(), eos=0, delay=0.01)
    server, url, _ = start(model_dir, engine)
    try:
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(
            httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30).status_code)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [200] * 4 and len(engine.calls) == 4 and engine.max_active == 1
    finally:
        server.shutdown()
        server.server_close()


def test_client_disconnect_mid_stream_stops_generation(model_dir: Path) -> None:
    text = ChatText(model_dir)
    engine = StandInEngine(vocab=text.tokenizer.get_vocab_size(), eos=0, delay=0.02)
    server, url, app = start(model_dir, engine, context=4096)
    try:
        port = server.server_address[1]
        body = json.dumps({**CHAT, "max_tokens": 3000, "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while got.count(b"data: ") < 3:
            got += sock.recv(65536)
        sock.close()
        deadline = time.monotonic() + 10
        while not engine.calls and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.calls, "generation did not stop after the client disconnected"
        assert engine.calls[0]["generated"] < 300  # 3000 asked; stops within a few bursts
        assert "glm53_cancelled_total 1" in httpx.get(url + "/metrics").text
        # the lane still serves
        assert httpx.post(url + "/v1/chat/completions", json=CHAT).status_code == 200
    finally:
        server.shutdown()
        server.server_close()


def test_engine_failure_is_500_then_health_503(model_dir: Path) -> None:
    text = ChatText(model_dir)
    engine = StandInEngine(vocab=text.tokenizer.get_vocab_size(), eos=0, fail=True)
    app = App(engine, text, FrontSettings(context=256), dict)
    server = FrontServer("127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert httpx.get(url + "/health").json()["status"] == "loading"
        server.attach(app)
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 500 and "rank 1" in r.json()["error"]["message"]
        assert app.fatal is not None
    finally:
        server.server_close()


def test_completions_stream_matches_plain(lane) -> None:
    url, _, _ = lane
    body = {"prompt": "hello world", "max_tokens": 8}
    plain = httpx.post(url + "/v1/completions", json=body).json()
    r = httpx.post(url + "/v1/completions", json={**body, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
