"""The HTTP front: an OpenAI-compatible server on the standard library.

Routes: POST /v1/chat/completions and /v1/completions (JSON or SSE streaming), GET /v1/models,
GET /health and /v1/health, GET /metrics. One engine behind a queue (see worker.py).
"""
from __future__ import annotations

import json
import os
import queue
import select
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from front.chat import ChatText, IncrementalDecoder, TemplateArgumentError, TemplateError
from front import observe
from front.metrics import Metrics
from front.protocol import GenerationRequest, RequestError, parse
from front.worker import EngineWorker, Job

DEFAULT_PORT = 8300
DEFAULT_MODEL_ID = "glm-5.3-exl3"
MAX_BODY_BYTES = 64 << 20


@dataclass
class FrontSettings:
    served_model: str = DEFAULT_MODEL_ID
    context: int = 16384  # prompt + completion tokens per request
    default_max_tokens: int = 1024  # when a request names no max_tokens
    ranks: int = 1
    prefix_cache: str = "absent"  # "on", "off" or "absent" (the engine has none): shown by /health
    drafting: bool = False  # the engine drafts (speculative decoding) unless a request says "draft": false
    prefill_chunk: int | None = None  # the engine's prefill grid: reuse happens in whole chunks


def prefix_cache_state(engine: Any) -> str:
    """What /health reports about reuse: "off" when TF_GLM53_PREFIX_CACHE says so (0, false, no or
    off, as kv_cache reads it); else the engine's `prefix_cache_enabled` flag if it has one; else
    its prefix cache object's own `enabled`; else "on" when it reuses the live conversation
    (glm53's `reuse_live`); "absent" otherwise."""
    if os.environ.get("TF_GLM53_PREFIX_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return "off"
    flag = getattr(engine, "prefix_cache_enabled", None)
    cache = getattr(engine, "prefix_cache", None)
    if flag is None and cache is not None and isinstance(getattr(cache, "enabled", None), bool):
        flag = cache.enabled
    if flag is None and (hasattr(engine, "prefix_cache") or hasattr(engine, "reuse_live")):
        flag = getattr(engine, "prefix_cache", None) is not None or bool(getattr(engine, "reuse_live", False))
    if flag is None:
        return "absent"
    return "on" if flag else "off"


def drafting_state(engine: Any) -> bool:
    """Whether requests are drafted unless they send "draft": false: the engine's own
    `drafting_enabled` when it has one, else a drafter present and drafts not turned off."""
    flag = getattr(engine, "drafting_enabled", None)
    if flag is not None:
        return bool(flag)
    return getattr(engine, "drafter", None) is not None and not getattr(engine, "no_drafts", False)


class App:
    """Everything a request needs: the worker (engine), the text side, the settings, the counters."""

    def __init__(self, engine: Any, text: ChatText, settings: FrontSettings,
                 sampling_factory: Callable[[dict[str, Any]], Any]) -> None:
        self.engine = engine
        self.text = text
        self.settings = settings
        self.sampling_factory = sampling_factory
        self.metrics = Metrics()
        self.eos = {int(t) for t in getattr(engine, "eos", []) or []}
        self.fatal: BaseException | None = None
        self.server: ThreadingHTTPServer | None = None
        self.worker = EngineWorker(engine, self._on_fatal)

    def _on_fatal(self, exc: BaseException) -> None:
        self.fatal = exc
        print(f"front: engine failed ({type(exc).__name__}: {exc}); stopping the lane", file=sys.stderr, flush=True)
        if self.server is not None:
            threading.Thread(target=self.server.shutdown, daemon=True).start()

    # ---- request preparation ---------------------------------------------------------------
    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.kind == "chat":
            try:
                rendered = self.text.render(request.messages or [], request.tools, request.template_kwargs)
            except TemplateArgumentError as exc:
                raise RequestError(str(exc), "chat_template_kwargs") from exc
            except (TemplateError, TypeError) as exc:  # a TypeError: content the template cannot handle
                raise RequestError(f"chat template failed: {exc}" if isinstance(exc, TypeError) else str(exc),
                                   "messages") from exc
            return self._encode(rendered, "messages")
        if isinstance(request.prompt, list):
            vocab = self.text.tokenizer.get_vocab_size(with_added_tokens=True)
            bad = [t for t in request.prompt if t >= vocab]
            if bad:
                raise RequestError(f"'prompt' has token id {bad[0]} outside the vocabulary (size {vocab})", "prompt")
            return list(request.prompt)
        return self._encode(request.prompt or "", "prompt")

    def _encode(self, text: str, field: str) -> list[int]:
        """Token ids of text the request brought; text the tokenizer refuses (a lone UTF-16
        surrogate from a JSON escape, say) is the request's error, not the server's."""
        try:
            return self.text.encode(text)
        except (TypeError, ValueError) as exc:
            raise RequestError(f"the text cannot be tokenized ({exc}); send valid Unicode", field) from exc

    def budget(self, request: GenerationRequest, n_prompt: int) -> int:
        """max_tokens for this request; refuses (400, with the limits) what the context cannot hold."""
        context = self.settings.context
        asked = request.max_tokens
        if n_prompt == 0:
            raise RequestError("the prompt encodes to no tokens", "messages" if request.kind == "chat" else "prompt")
        max_tokens = asked if asked is not None else min(self.settings.default_max_tokens, context - n_prompt)
        if n_prompt >= context or n_prompt + max_tokens > context:
            field = "max_tokens" if n_prompt < context else ("messages" if request.kind == "chat" else "prompt")
            raise RequestError(
                f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens if asked is not None else 'unset'}; "
                f"together they must fit the context of {context} tokens "
                f"(at most {max(context - n_prompt, 0)} new tokens for this prompt)", field)
        return max_tokens

    def finish_reason(self, tokens: list[int], sampling: dict[str, Any]) -> str:
        if tokens and tokens[-1] in self.eos and not sampling.get("ignore_eos"):
            return "stop"
        return "length"

    def usage(self, n_prompt: int, tokens: list[int], stats: dict[str, Any]) -> dict[str, Any]:
        cached = int(stats.get("cached_tokens", 0) or 0)
        return {"prompt_tokens": n_prompt, "completion_tokens": len(tokens),
                "total_tokens": n_prompt + len(tokens), "prompt_tokens_details": {"cached_tokens": cached}}

    def health(self) -> tuple[int, dict[str, Any]]:
        body = {"status": "ok" if self.fatal is None else "failed", "model": self.settings.served_model,
                "ranks": self.settings.ranks, "context": self.settings.context,
                "prefix_cache": self.settings.prefix_cache, "drafting": self.settings.drafting,
                "prefill_chunk": self.settings.prefill_chunk, "queue_depth": self.worker.depth()}
        memory = getattr(self.engine, "memory", None)  # rank 0's weights on the device (glm53.model.memory)
        if memory is not None:
            body["memory"] = memory
        return (200 if self.fatal is None else 503), body


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "glm53-front"
    server: "FrontServer"

    @property
    def app(self) -> App:
        return self.server.app  # type: ignore[return-value]

    def log_message(self, format: str, *args: Any) -> None:  # access log to stderr, one line
        sys.stderr.write(f"front: {self.address_string()} {format % args}\n")

    # ---- plumbing ----------------------------------------------------------------------------
    def _send_json(self, status: int, body: Any, route: str) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        if self.server.app is not None:
            self.server.app.metrics.request(route, status)

    def _send_error(self, status: int, message: str, route: str, param: str | None = None,
                    kind: str = "invalid_request_error") -> None:
        self._send_json(status, {"error": {"message": message, "type": kind, "param": param, "code": status}}, route)

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _read_json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if length <= 0:
            raise RequestError("the request needs a JSON body (Content-Length was 0)")
        if length > MAX_BODY_BYTES:
            raise RequestError(f"the body is {length} bytes; the limit is {MAX_BODY_BYTES}")
        raw = self.rfile.read(length)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"the body is not valid JSON: {exc}") from exc

    # ---- routes ------------------------------------------------------------------------------
    def _loading(self, path: str) -> bool:
        if self.server.app is not None:
            return False
        self._send_json(503, {"status": "loading", "error": {"message": "the engine is still loading",
                                                             "type": "server_error", "code": 503}}, path)
        return True

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if self._loading(path):
            return
        app = self.app
        if path in ("/health", "/v1/health"):
            status, body = app.health()
            self._send_json(status, body, "/health")
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [{
                "id": app.settings.served_model, "object": "model", "created": 0, "owned_by": "glm53-kit",
                "max_model_len": app.settings.context}]}, "/v1/models")
        elif path == "/metrics":
            data = (app.metrics.render(app.worker.depth()) + observe.render(app.engine)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._send_error(404, f"no route GET {path}; try /v1/models, /health, /metrics", "other")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        kinds = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
        if path not in kinds:
            self._send_error(404, f"no route POST {path}; try /v1/chat/completions or /v1/completions", "other")
            return
        if self._loading(path):
            return
        app = self.app
        if app.fatal is not None:
            self._send_error(503, f"the engine failed: {app.fatal}", path, kind="server_error")
            return
        try:
            request = parse(self._read_json(), kinds[path])
            if request.model not in (None, app.settings.served_model):
                self._send_error(404, f"model {request.model!r} is not served here; this server serves "
                                      f"{app.settings.served_model!r}", path, "model", "not_found_error")
                return
            prompt = app.prompt_ids(request)
            max_tokens = app.budget(request, len(prompt))
            try:
                sampling = app.sampling_factory(dict(request.sampling))
            except (ValueError, TypeError) as exc:
                raise RequestError(f"bad sampling parameters: {exc}") from exc
        except RequestError as exc:
            self._send_error(400, str(exc), path, exc.param)
            return
        job = Job(prompt=prompt, max_tokens=max_tokens, sampling=sampling,
                  rid=("chatcmpl-" if request.kind == "chat" else "cmpl-") + uuid.uuid4().hex)
        app.worker.submit(job)
        if request.stream:
            self._stream(request, job, path)
        else:
            self._complete(request, job, path)

    def _events(self, job: Job):
        """Yield the job's events; a client that disconnects cancels the job."""
        while True:
            try:
                kind, value = job.events.get(timeout=0.2)
            except queue.Empty:  # check the client is still there
                if self._client_gone():
                    job.cancelled.set()
                continue
            yield kind, value
            if kind in ("done", "error"):
                return

    def _finish_metrics(self, n_prompt: int, result: dict[str, Any]) -> None:
        self.app.metrics.add(prompt_tokens=n_prompt, completion_tokens=len(result["tokens"]),
                             cached_tokens=int(result["stats"].get("cached_tokens", 0) or 0),
                             cancelled=int(bool(result.get("cancelled"))))

    def _complete(self, request: GenerationRequest, job: Job, route: str) -> None:
        app = self.app
        for kind, value in self._events(job):
            if kind == "error":
                self._send_error(500, f"the engine failed: {type(value).__name__}: {value}", route, kind="server_error")
                return
            if kind == "done":
                self._finish_metrics(len(job.prompt), value)
                if value.get("cancelled"):
                    self.app.metrics.request(route, 499)  # client closed the request
                    self.close_connection = True
                    return
                tokens = value["tokens"]
                text = app.text.decode(tokens)
                finish = app.finish_reason(tokens, request.sampling)
                usage = app.usage(len(job.prompt), tokens, value["stats"])
                rid = job.rid
                if request.kind == "chat":
                    choice = {"index": 0, "message": {"role": "assistant", "content": text},
                              "finish_reason": finish, "logprobs": None}
                    obj = "chat.completion"
                else:
                    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
                    obj = "text_completion"
                self._send_json(200, {"id": rid, "object": obj, "created": int(time.time()),
                                      "model": app.settings.served_model, "choices": [choice], "usage": usage}, route)

    def _stream(self, request: GenerationRequest, job: Job, route: str) -> None:
        app = self.app
        chat = request.kind == "chat"
        rid = job.rid
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": app.settings.served_model}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def send(payload: Any) -> bool:
            data = b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"
            if self._client_gone():
                return False
            try:
                self.wfile.write(data)
                self.wfile.flush()
                return True
            except OSError:
                return False

        def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if delta_text:
                    delta["content"] = delta_text
                return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
            return {**base, "choices": [{"index": 0, "text": delta_text or "", "finish_reason": finish,
                                         "logprobs": None}]}

        decoder = IncrementalDecoder(app.text)
        alive = send(chunk("", None, role=True)) if chat else True
        if not alive:
            job.cancelled.set()
        for kind, value in self._events(job):
            if kind == "tokens":
                delta = decoder.push(value)
                if alive and delta and not send(chunk(delta, None)):
                    alive = False
                    job.cancelled.set()
            elif kind == "error":
                app.metrics.request(route, 500)
                send({"error": {"message": f"the engine failed: {type(value).__name__}: {value}",
                                "type": "server_error", "code": 500}})
                return
            else:
                self._finish_metrics(len(job.prompt), value)
                if value.get("cancelled") or not alive:
                    app.metrics.request(route, 499)
                    return
                tokens = value["tokens"]
                tail = decoder.finish()
                send(chunk(tail or None, app.finish_reason(tokens, request.sampling)))
                if request.include_usage:
                    send({**base, "choices": [], "usage": app.usage(len(job.prompt), tokens, value["stats"])})
                send(b"[DONE]")
                app.metrics.request(route, 200)


class FrontServer(ThreadingHTTPServer):
    """Binds at once (a taken port fails before any loading); answers 503 "loading" until an App
    is attached with `attach`."""

    daemon_threads = True

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
        self.app: App | None = None
        super().__init__((host, port), Handler)

    def attach(self, app: App) -> None:
        app.server = self
        self.app = app


def make_server(app: App, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> FrontServer:
    """Bind (raises OSError if the port is taken) and serve `app`; call serve_forever()."""
    server = FrontServer(host, port)
    server.attach(app)
    return server
