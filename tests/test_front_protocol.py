"""The front against what clients get wrong or push too far, on raw sockets: connections stay framed
after every error, a huge prompt stalls nothing, and API keys guard /v1 (official client included).

Each test is a regression of the standard-library server this front replaced: an unread body was
parsed as the next request (a 501 HTML page for a valid one), `Content-Length: abc` dropped the
connection with a traceback, PUT/DELETE/OPTIONS answered HTML, and a 50 MB prompt was templated
and tokenized before any check while /health timed out.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from glm53.serving.front.auth import configured_keys
from glm53.settings import Settings
from lane_fixtures import front_server, standin_for, write_tokenizer

CHAT = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return d


class Connection:
    """One keep-alive connection: raw requests out, parsed responses in."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    def send(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
             chunked: bool = False) -> tuple[int, dict[str, str], bytes]:
        head = {"Host": "x", "Content-Type": "application/json", **(headers or {})}
        if chunked:
            head["Transfer-Encoding"] = "chunked"
            half = len(body) // 2
            payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:half], body[half:]) if p) + b"0\r\n\r\n"
        else:
            head.setdefault("Content-Length", str(len(body)))
            payload = body
        lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items())]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        return self.read()

    def read(self) -> tuple[int, dict[str, str], bytes]:
        response = http.client.HTTPResponse(self.sock)
        response.begin()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()

    def chat(self) -> None:
        """A valid request on this connection succeeds: the previous one left nothing behind."""
        status, _, body = self.send("POST", "/v1/chat/completions", json.dumps(CHAT).encode())
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 4


def openai_error(status: int, body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def test_a_connection_stays_framed_after_every_error(model_dir: Path) -> None:
    with front_server(model_dir, standin_for(model_dir), max_body_bytes=2048) as server:
        conn = Connection(server.port)
        body = json.dumps(CHAT).encode()
        # an unknown route with a body, plain and chunked: the body is discarded, not parsed
        for chunked in (False, True):
            status, _, reply = conn.send("POST", "/v1/embeddings", body, chunked=chunked)
            assert status == 404 and openai_error(status, reply)["type"] == "not_found_error"
            conn.chat()
        status, _, reply = conn.send("POST", "/v1/chat/completions", body, chunked=True)  # a chunked request is served
        assert status == 200 and json.loads(reply)["choices"][0]["message"]["content"]
        # a body over the limit: refused by its Content-Length before it is read, or as it arrives (chunked)
        big = json.dumps({**CHAT, "pad": "x" * 4096}).encode()
        for chunked in (False, True):
            status, _, reply = conn.send("POST", "/v1/chat/completions", big, chunked=chunked)
            assert status == 413 and "2048 bytes" in openai_error(status, reply)["message"]
            conn.chat()
        # methods without a route: JSON 405 naming what is allowed
        for method in ("PUT", "DELETE", "OPTIONS"):
            status, headers, reply = conn.send(method, "/v1/chat/completions", body)
            assert status == 405 and headers["allow"] == "POST" and headers["content-type"] == "application/json"
            assert method in openai_error(status, reply)["message"]
            conn.chat()
        status, headers, reply = conn.send("GET", "/v1/models/no-such-model")
        assert status == 404 and openai_error(status, reply)["code"] == "model_not_found"
        conn.chat()
        # a Content-Length that is not a number: the framing is lost, so a JSON 400 and the connection
        # closes (RFC 9112 6.3); the server goes on serving new connections
        status, headers, reply = conn.send("POST", "/v1/chat/completions", body, {"Content-Length": "abc"})
        assert status == 400 and headers["connection"] == "close"
        assert "malformed HTTP" in openai_error(status, reply)["message"]
        assert conn.sock.recv(1) == b""
        Connection(server.port).chat()


def refused_while_serving(url: str, body: bytes) -> tuple[dict, float]:
    """POST `body` to the chat route; while it is handled, poll /health, then send a small chat
    request. Returns the big request's error and the slowest /health."""
    result: dict[str, object] = {}

    def send_big() -> None:
        r = httpx.post(url + "/v1/chat/completions", content=body, timeout=60,
                       headers={"Content-Type": "application/json"})
        result.update(status=r.status_code, error=r.json()["error"])

    big = threading.Thread(target=send_big)
    big.start()
    slowest = 0.0
    with httpx.Client(base_url=url, timeout=10) as client:
        while big.is_alive():
            t0 = time.monotonic()
            assert client.get("/health").status_code == 200
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.01)
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    big.join()
    assert result["status"] == 400, result
    return result["error"], slowest  # type: ignore[return-value]


def test_a_huge_prompt_is_refused_while_everything_else_is_served(model_dir: Path) -> None:
    """50 MB of prompt is refused before the template and the tokenizer run (400 by its bytes of text;
    413 by its Content-Length under the default body limit); a prompt the byte bound lets through is
    templated and tokenized off the event loop. Meanwhile /health and other requests are answered."""
    prompt = json.dumps({"messages": [{"role": "user", "content": "x" * 50_000_000}], "max_tokens": 4}).encode()
    engine = standin_for(model_dir)
    with front_server(model_dir, engine, max_body_bytes=64 << 20) as server:
        settings = server.state.service.settings
        error, slowest = refused_while_serving(server.url, prompt)
        assert error["code"] == "context_length_exceeded" and "50000000 bytes of text" in error["message"]
        assert slowest < 2, f"/health took {slowest:.2f} s while the huge prompt was handled"
        # 1 MB that a looser byte bound lets through: 0.7 s of tokenizer, then refused by its tokens
        settings.prompt_bytes_per_token = 10**5
        words = json.dumps({"messages": [{"role": "user", "content": "the quick brown fox " * 50_000}]}).encode()
        error, slowest = refused_while_serving(server.url, words)
        assert error["code"] == "context_length_exceeded" and "context of 256 tokens" in error["message"]
        assert slowest < 0.5, f"/health took {slowest:.2f} s while the prompt was tokenized"
        assert len(engine.calls) == 2  # the small chat requests: never the big ones
        settings.max_body_bytes = 32 << 20  # the default
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/chat/completions", content=prompt,
                       headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert time.monotonic() - t0 < 15


def test_api_keys_guard_v1_and_leave_health_open(model_dir: Path) -> None:
    keys = configured_keys(["k1"], Settings.from_env({"TF_GLM53_API_KEYS": " k2 ,, k3"}))
    assert keys == ("k1", "k2", "k3") and configured_keys([], Settings()) == () and configured_keys([]) == ()
    with front_server(model_dir, standin_for(model_dir), api_keys=keys) as server:
        url = server.url
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "k1x"}, {"Authorization": "Basic k1"}):
            r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", headers
            assert openai_error(401, r.content)["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"x-api-key": "k3"}).status_code == 200
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                          headers={"Authorization": "bearer k2"}).status_code == 200
        for open_path in ("/health", "/v1/health", "/metrics"):
            assert httpx.get(url + open_path).status_code == 200, open_path
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
        assert sdk.chat.completions.create(model="glm-5.3-exl3", **CHAT).usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError) as refused:
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
        assert refused.value.code == "invalid_api_key"
        # verify.sh: the base URL as OpenAI clients take it (with /v1), and the key
        from launcher.verify import Verifier

        assert Verifier(url + "/v1/", timeout=30, max_tokens=6, api_key="k2").run() == 0
        assert Verifier(url, timeout=30, max_tokens=6).run() == 2  # no key: said so, not a KeyError


def test_routing_and_parameter_errors_are_openai_shaped() -> None:
    """FastAPI's own refusals (a path or query parameter it validates: 422 by default) and a bug in
    a route (500) in OpenAI's shape too, through the app itself (Starlette's TestClient)."""
    from starlette.testclient import TestClient

    from glm53.serving.front.app import create_app
    from glm53.serving.front.state import FrontState

    app = create_app(FrontState())

    @app.get("/probe/{n}")
    async def probe(n: int, flag: bool = False) -> dict:
        return {"n": 1 // (n - 1), "flag": flag}

    with TestClient(app, raise_server_exceptions=False) as client:
        for path, status, param in (("/probe/x", 400, "n"), ("/probe/3?flag=maybe", 400, "flag"),
                                    ("/probe/1", 500, None)):
            r = client.get(path)
            assert r.status_code == status and openai_error(status, r.content)["param"] == param, r.text
