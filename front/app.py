"""The front's routes on FastAPI: POST /v1/chat/completions and /v1/completions (JSON or SSE),
GET /v1/models and /v1/models/{id}, GET /health and /v1/health, GET /metrics.

A generation request goes: API key, lane state (503 while loading, draining or failed), body under
its limit, then on the service's thread pool the validation and the prompt (template, tokenizer,
bounds), then a job on the engine's worker; its events come back to this loop. A client that
disconnects, streaming or not, cancels its job: the engine stops at its next decode step.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from front import observe, replies
from front.access import AccessLog, AccessRecord, record_of
from front.auth import check_key
from front.errors import ApiError, error_body, on_api_error, on_http_exception, on_request_validation, on_unexpected
from front.metrics import CONTENT_TYPE, Metrics
from front.observe import Timing
from front.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest, parse
from front.service import Prepared, Service
from front.worker import Job

# what a JSON body may be labelled; curl -d sends form-urlencoded unless told otherwise
JSON_TYPES = ("", "application/json", "text/plain", "application/x-www-form-urlencoded")


class FrontState:
    """What the routes read: the service (None while the engine loads), the API keys, whether the lane
    drains, the requests in flight, and the front's metrics."""

    def __init__(self, api_keys: tuple[str, ...] = (), retry_after_s: int = 5) -> None:
        self.service: Service | None = None
        self.api_keys = api_keys
        self.retry_after_s = retry_after_s
        self.draining = False
        self.inflight = 0
        self.metrics = Metrics(lambda: self.service.worker.depth() if self.service else 0,
                               lambda: self.service.worker.runtime_stats() if self.service else None)

    def serving(self) -> Service:
        """The service, or the 503 that says why there is none to take new work."""
        retry = {"Retry-After": str(self.retry_after_s)}
        if self.service is None:
            raise ApiError(503, "the engine is still loading", code="loading", headers=retry)
        if self.draining:
            raise ApiError(503, "the server is shutting down and takes no new requests", code="draining",
                           headers=retry)
        self.service.refuse_if_failed()
        return self.service


class JobEvents:
    """A job's events, handed from the engine's thread to this request's event loop. `on_done` sees
    the job's result on the engine's thread, whether or not anyone still reads the events."""

    def __init__(self, on_done: Callable[[dict[str, Any]], None]) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.on_done = on_done

    def put(self, item: tuple[str, Any]) -> None:
        if item[0] == "done":
            self.on_done(item[1])
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server stopped, nobody waits for this job
            pass

    async def get(self) -> tuple[str, Any]:
        return await self.queue.get()


def create_app(front: FrontState) -> FastAPI:
    app = FastAPI(title="glm53-front", openapi_url=None, docs_url=None, redoc_url=None)
    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(HTTPException, on_http_exception)
    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(Exception, on_unexpected)
    app.add_middleware(AccessLog, front=front)

    async def authorized(request: Request) -> None:  # async: FastAPI would run a plain def on a thread
        check_key(request.headers, front.api_keys)

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> JSONResponse:
        if front.service is None:
            return JSONResponse({"status": "loading", **error_body(503, "the engine is still loading", code="loading")},
                                503)
        body = front.service.health()
        if front.draining and body["status"] == "ok":
            body["status"] = "draining"
        return JSONResponse(body, 200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = front.metrics.render()
        if front.service is not None:  # the cache's and drafter's counters: read off the loop, not behind prompts
            text += await asyncio.get_running_loop().run_in_executor(None, observe.render, front.service.engine)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(front.serving())]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)])
    async def model(model_id: str) -> dict[str, Any]:
        service = front.serving()
        if model_id != service.settings.served_model:
            raise unknown_model(model_id, service, "model")
        return model_card(service)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(request: Request) -> Response:
        return await generate(front, request, ChatCompletionRequest)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request) -> Response:
        return await generate(front, request, CompletionRequest)

    return app


def model_card(service: Service) -> dict[str, Any]:
    return {"id": service.settings.served_model, "object": "model", "created": 0, "owned_by": "glm53-kit",
            "max_model_len": service.settings.context}


def unknown_model(name: str, service: Service, param: str | None) -> ApiError:
    return ApiError(404, f"model {name!r} is not served here; this server serves {service.settings.served_model!r}",
                    param, "model_not_found")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) once it passes `limit`: by its Content-Length before any of it is read,
    or as it arrives (chunked). What is left unread is discarded by the server, not parsed."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind not in JSON_TYPES and not kind.endswith("+json"):
        raise ApiError(415, f"the body must be JSON (Content-Type: application/json), not {kind!r}")
    declared = request.headers.get("content-length")
    too_large = ApiError(413, f"the body is larger than this server's limit of {limit} bytes",
                         code="request_too_large")
    if declared is not None and int(declared) > limit:  # h11 has checked that it is a number
        raise too_large
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_large
            parts.append(part)
    except ClientDisconnect:
        raise ApiError(499, "the client closed the connection before its body arrived") from None
    if not size:
        raise ApiError(400, "the request needs a JSON body")
    return b"".join(parts)


async def generate(front: FrontState, request: Request,
                   model: type[ChatCompletionRequest] | type[CompletionRequest]) -> Response:
    service = front.serving()
    raw = await read_body(request, service.settings.max_body_bytes)
    loop = asyncio.get_running_loop()
    body: GenerationRequest = await loop.run_in_executor(service.pool, parse, raw, model)
    if body.model not in (None, service.settings.served_model):
        raise unknown_model(body.model, service, "model")
    prepared: Prepared = await loop.run_in_executor(service.pool, service.prepare, body)
    record = record_of(request.scope)
    chat = isinstance(body, ChatCompletionRequest)
    head = replies.ReplyHead(("chatcmpl-" if chat else "cmpl-") + record.rid, service.settings.served_model, chat)
    events = JobEvents(lambda result: record_job(front.metrics, job, result))
    job = Job(prompt=prepared.prompt, max_tokens=prepared.max_tokens, sampling=prepared.sampling, events=events,
              rid=head.id, timing=Timing(time.perf_counter(), arrived=record.start))
    service.worker.submit(job)
    run = Generation(service, body, job, events, record, head)
    if body.stream:
        return StreamingResponse(run.stream(request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await run.complete(request)


def record_job(metrics: Metrics, job: Job, result: dict[str, Any]) -> None:
    timing, n = job.timing, len(result["tokens"])
    metrics.generation(len(job.prompt), n, result["stats"], bool(result.get("cancelled")), timing.queue_wait,
                       timing.ttft, timing.decode_rate(n))


class Generation:
    """One submitted job and its reply: awaited whole, or streamed as SSE chunks."""

    def __init__(self, service: Service, body: GenerationRequest, job: Job, events: JobEvents, record: AccessRecord,
                 head: replies.ReplyHead) -> None:
        self.service, self.body, self.job, self.events, self.record, self.head = service, body, job, events, record, head
        self.finished = False

    def watch(self, request: Request) -> asyncio.Task[None]:
        """A task that cancels the job when the client disconnects (the ASGI disconnect message)."""

        async def until_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.job.cancelled.set()

        return asyncio.ensure_future(until_gone())

    def stop(self, watcher: asyncio.Task[None]) -> None:
        watcher.cancel()
        if not self.finished:  # the response was abandoned (client gone, server stopping): so is the job
            self.job.cancelled.set()
            self.record.outcome = 499

    def failure(self, exc: BaseException) -> ApiError:
        self.finished = True
        return ApiError(500, f"the engine failed: {type(exc).__name__}: {exc}", code="engine_failed")

    def usage(self, result: dict[str, Any]) -> dict[str, Any]:
        return self.service.usage(len(self.job.prompt), result["tokens"], result["stats"])

    async def complete(self, request: Request) -> Response:
        watcher = self.watch(request)
        try:
            while True:
                kind, value = await self.events.get()
                if kind == "error":
                    raise self.failure(value)
                if kind == "done":
                    self.finished = True
                    break
        finally:
            self.stop(watcher)
        if value.get("cancelled"):
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        tokens = value["tokens"]
        return JSONResponse(replies.completion_body(
            self.head, replies.message(self.service.text, tokens),
            self.service.finish_reason(tokens, self.body.sampling()), self.usage(value)))

    async def stream(self, request: Request) -> AsyncIterator[bytes]:
        deltas = replies.MessageDeltas(self.service.text)
        watcher = self.watch(request)
        try:
            if self.head.chat:
                yield replies.sse(replies.chunk(self.head, {"role": "assistant", "content": ""}))
            while True:
                kind, value = await self.events.get()
                if kind == "tokens":
                    for delta in deltas.push(value):
                        yield replies.sse(replies.chunk(self.head, delta))
                    continue
                if kind == "error":
                    error = self.failure(value)
                    self.record.outcome = 500
                    yield replies.sse(error.body())
                    return
                self.finished = True
                if value.get("cancelled"):
                    self.record.outcome = 499
                    return
                for delta in deltas.finish():
                    yield replies.sse(replies.chunk(self.head, delta))
                tokens = value["tokens"]
                yield replies.sse(replies.chunk(self.head, {}, self.service.finish_reason(tokens, self.body.sampling())))
                if self.body.include_usage:
                    yield replies.sse(replies.chunk(self.head, None, usage=self.usage(value)))
                yield replies.sse("[DONE]")
                return
        finally:
            self.stop(watcher)
