"""The front's own HTTP behaviour, on a real server (uvicorn) on loopback, with the official `openai`
client where a client is natural.

The engine here is a stand-in (tests/lane_fixtures.StandInEngine): these tests exercise the
front (validation, queueing, SSE, disconnects, errors, metrics), not the model. The same front over
the real glm53 engine on the tiny checkpoint is tested in tests/test_serve_local.py.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import httpx
import openai
import pytest

from lane_fixtures import front_server, standin_for, wait_for, write_tokenizer
from tests.prometheus_text import parse_prometheus, value


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def shared(model_dir: Path):
    """One front for the tests that only read what the engine was asked (engine.calls)."""
    engine = standin_for(model_dir)
    with front_server(model_dir, engine) as server:
        yield server, engine


@pytest.fixture
def lane(shared):
    """(url, engine, the openai client) on the shared front; engine.calls starts empty."""
    server, engine = shared
    engine.calls.clear()
    yield server.url, engine, client(server.url)


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


CHAT = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 10, "temperature": 0}
MODEL = "glm-5.3-exl3"


def test_chat_completion_has_content_finish_reason_and_usage(lane) -> None:
    url, engine, sdk = lane
    reply = sdk.chat.completions.create(model=MODEL, **CHAT)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == MODEL and reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 10
    assert reply.usage.prompt_tokens == len(engine.calls[0]["prompt"])
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    # the prompt is the chat template rendered and encoded (GLM specials as single tokens)
    assert engine.calls[0]["prompt"][:2] == [1, 2]  # [gMASK] <sop>
    # "developer" (OpenAI's newer name for the system role) reaches GLM's template as "system"
    as_system = sdk.chat.completions.create(model=MODEL, **{**CHAT, "messages": [
        {"role": "system", "content": "be brief"}, *CHAT["messages"]]})
    as_developer = sdk.chat.completions.create(model=MODEL, **{**CHAT, "messages": [
        {"role": "developer", "content": "be brief"}, *CHAT["messages"]]})
    assert engine.calls[1]["prompt"] == engine.calls[2]["prompt"]
    assert as_system.choices[0].message.content == as_developer.choices[0].message.content


def test_resend_reports_cached_tokens_and_stop_at_eos(model_dir: Path) -> None:
    with front_server(model_dir, standin_for(model_dir, stop_after=4)) as server:
        sdk = client(server.url)
        first = sdk.chat.completions.create(model=MODEL, **CHAT)
        assert first.choices[0].finish_reason == "stop"
        assert first.usage.completion_tokens == 5  # 4 tokens + eos
        longer = {**CHAT, "messages": CHAT["messages"] + [{"role": "assistant", "content": "fine"},
                                                         {"role": "user", "content": "and you?"}]}
        second = sdk.chat.completions.create(model=MODEL, **longer)
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        ignore = sdk.chat.completions.create(model=MODEL, **CHAT, extra_body={"ignore_eos": True})
        assert ignore.choices[0].finish_reason == "length"
        assert ignore.usage.completion_tokens == 10


def test_stream_delivers_the_same_text_and_usage(lane) -> None:
    url, _, sdk = lane
    plain = sdk.chat.completions.create(model=MODEL, **CHAT)
    chunks = list(sdk.chat.completions.create(model=MODEL, **CHAT, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert len({c.id for c in chunks}) == 1
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.completion_tokens == plain.usage.completion_tokens == 10
    assert usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens  # resend
    raw = httpx.post(url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream") and raw.text.endswith("data: [DONE]\n\n")


def test_completions_route_with_text_and_token_prompts(lane) -> None:
    _, engine, sdk = lane
    a = sdk.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=5)
    assert a.object == "text_completion" and a.usage.completion_tokens == 5 and a.choices[0].text
    ids = engine.calls[-1]["prompt"]
    b = sdk.completions.create(model=MODEL, prompt=ids, max_tokens=5)
    assert b.choices[0].text == a.choices[0].text
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=MODEL, prompt=[10**7], max_tokens=5)
    assert bad.value.param == "prompt"
    streamed = list(sdk.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=5, stream=True))
    assert all(c.object == "text_completion" for c in streamed)
    assert "".join(c.choices[0].text for c in streamed) == a.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


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
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "top_p": 1.5}, "top_p"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({**CHAT, "draft": "no"}, "draft"),
    ({**CHAT, "n": 17}, "n"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**CHAT, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
])
def test_bad_requests_get_400_naming_the_field(lane, body, param) -> None:
    url, engine, _ = lane
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split("[")[0].split(".")[0] in err["message"]
    assert err["type"] == "invalid_request_error"
    assert engine.calls == []


def test_untokenizable_text_and_clashing_template_arguments_are_400(lane) -> None:
    """A lone surrogate (valid JSON escape, not valid Unicode) and chat_template_kwargs naming an
    argument the front passes itself are the request's errors, answered as such."""
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
    url, _, sdk = lane
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", content=b"[1]", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk.chat.completions.create(model="gpt-4", **CHAT)
    assert MODEL in unknown.value.message and unknown.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk.models.retrieve("gpt-4")
    assert unknown.value.body["type"] == "not_found_error"
    r = httpx.post(url + "/v1/chat/completions", content=b"<a/>", headers={"Content-Type": "application/xml"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"


def test_prompt_longer_than_context_is_400_with_the_limits(lane) -> None:
    url, engine, _ = lane
    long = {"messages": [{"role": "user", "content": "the quick brown fox " * 200}], "max_tokens": 10}
    r = httpx.post(url + "/v1/chat/completions", json=long)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    n_prompt = int(msg.split("prompt has ")[1].split()[0])
    assert n_prompt > 256 and "max_tokens is 10" in msg and "context of 256 tokens" in msg
    assert r.json()["error"]["code"] == "context_length_exceeded"
    # fits alone, but not with the requested completion
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 250})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "at most" in r.json()["error"]["message"]
    # more text than the context could hold at any tokenization: refused before the tokenizer runs
    r = httpx.post(url + "/v1/completions", json={"prompt": "x" * (256 * 16 + 1)})
    assert r.status_code == 400 and "4097 bytes of text" in r.json()["error"]["message"]
    assert engine.calls == []


def test_models_health_metrics(model_dir: Path) -> None:
    with front_server(model_dir, standin_for(model_dir)) as server:
        url, sdk = server.url, client(server.url)
        assert [m.id for m in sdk.models.list()] == [MODEL]
        assert sdk.models.retrieve(MODEL).id == MODEL
        for path in ("/health", "/v1/health"):
            h = httpx.get(url + path)
            assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["prefix_cache"] == "absent"
        sdk.chat.completions.create(model=MODEL, **CHAT)
        list(sdk.chat.completions.create(model=MODEL, **CHAT, stream=True))
        httpx.post(url + "/v1/chat/completions", json={"messages": []})
        r = httpx.get(url + "/metrics")
        assert r.headers["content-type"].startswith("text/plain")
        m = parse_prometheus(r.text)
        assert value(m, "glm53_requests_total", route="/v1/chat/completions", status="200") == 2
        assert value(m, "glm53_requests_total", route="/v1/chat/completions", status="400") == 1
        assert value(m, "glm53_completion_tokens_total") == 20 and value(m, "glm53_errors_total") == 1
        assert value(m, "glm53_queue_depth") == 0
        for family, n in (("glm53_queue_wait_seconds", 2), ("glm53_time_to_first_token_seconds", 2),
                          ("glm53_decode_tokens_per_second", 2), ("glm53_request_duration_seconds", 3)):
            assert value(m, family + "_count") == n and value(m, family + "_sum") > 0, family  # the 400 has a duration


def test_requests_are_serialized_on_the_engine(model_dir: Path) -> None:
    engine = standin_for(model_dir, delay=0.01)
    with front_server(model_dir, engine) as server:
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(
            httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [200] * 4 and len(engine.calls) == 4 and engine.max_active == 1


def post_and_leave(port: int, body: dict, leave: Callable[[bytes], bool]) -> None:
    """POST on a raw socket, and close it once `leave(what came so far)` says so."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    sock.settimeout(0.005)
    got = b""
    deadline = time.monotonic() + 10
    while not leave(got) and time.monotonic() < deadline:
        try:
            got += sock.recv(65536)
        except TimeoutError:
            pass
    sock.close()


def wait_for_call(engine, n: int) -> dict:
    deadline = time.monotonic() + 10
    while len(engine.calls) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.calls) >= n, "generation did not stop after the client disconnected"
    return engine.calls[n - 1]


def test_a_client_that_disconnects_stops_its_generation(model_dir: Path) -> None:
    """Streaming or not, the engine stops within a decode step of the disconnect (a request that runs
    on holds the engine for its whole reply: thousands of tokens, the next request waiting behind it),
    and the lane serves the next request at once."""
    engine = standin_for(model_dir, delay=0.02)  # a burst (decode step) of 3 tokens every 20 ms
    with front_server(model_dir, engine, context=4096) as server:
        for n, stream in enumerate((True, False), 1):
            gone_at: list[int] = []
            post_and_leave(server.port, {**CHAT, "max_tokens": 3000, "stream": stream},  # once it decodes
                           lambda _: engine.active and engine.progress >= 15 and not gone_at.append(engine.progress))
            generated = wait_for_call(engine, n)["generated"]
            assert generated <= gone_at[0] + 6, (stream, gone_at, generated)  # its step, and the one racing it
            t0 = time.monotonic()
            assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
            assert time.monotonic() - t0 < 2
            engine.calls.pop()
        counted = ('glm53_cancelled_total 2.0', 'glm53_requests_total{route="/v1/chat/completions",status="499"} 2.0')
        wait_for(lambda: all(c in httpx.get(server.url + "/metrics").text for c in counted), 5, "the counts")


def test_loading_then_engine_failure(model_dir: Path) -> None:
    """503 "loading" (with Retry-After) before the engine is attached; an engine failure is a 500 for
    its request, then 503 for new ones and on /health."""
    from glm53.serving.front.chat import ChatText
    from glm53.serving.front.server import FrontServer
    from glm53.serving.front.service import Service
    from glm53.serving.front.settings import FrontSettings

    server = FrontServer("127.0.0.1", 0).start()
    service = Service(standin_for(model_dir, fail=True), ChatText(model_dir), FrontSettings(context=256), dict)
    try:
        h = httpx.get(server.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "loading"
        r = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "loading"
        server.attach(service)
        r = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 500 and "rank 1" in r.json()["error"]["message"]
        assert service.fatal is not None
        assert httpx.get(server.url + "/health").status_code == 503
        r = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
    finally:
        server.shutdown()
        service.close()


def test_stream_deltas_decode_a_window_not_the_whole_reply(model_dir: Path) -> None:
    """Deltas joined equal the whole decode, multi-byte characters whole, and each push decodes a
    few ids: the deltas run on the event loop, where decoding the reply so far each time would cost
    quadratic time in a long stream."""
    from glm53.serving.front.chat import ChatText, IncrementalDecoder

    text = ChatText(model_dir)
    ids = text.encode("naïve café — üñïçødé ☃ text, " * 40)
    lengths: list[int] = []
    decode = text.decode
    text.decode = lambda window: lengths.append(len(window)) or decode(window)  # type: ignore[method-assign]
    decoder = IncrementalDecoder(text)
    deltas = [decoder.push([i]) for i in ids] + [decoder.finish()]
    assert "".join(deltas) == decode(ids) and all("\ufffd" not in d for d in deltas)
    assert max(lengths) <= 8
