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
from front.logprobs import LogprobsShaper
from front.access import AccessLog, AccessRecord, record_of
from front.auth import check_key
from front.errors import ApiError, error_body, on_api_error, on_http_exception, on_request_validation, on_unexpected
from front.metrics import CONTENT_TYPE, Metrics
from front.observe import Timing
from front.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest, parse
from front.service import Prepared, Service
from front.stop import StopScanner
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
        self.metrics = Metrics(lambda: self.service.worker.depth() if self.service else 0)

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
    # n choices are n jobs, queued together: the engine decodes them one after another
    choices = [submit(front, service, prepared, sampling, head, record, i)
               for i, sampling in enumerate(prepared.samplings)]
    run = Generation(service, body, choices, record, head)
    if body.stream:
        return StreamingResponse(run.stream(request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await run.complete(request)


class Choice:
    """One choice of a reply: its job, the job's events, and what the reply keeps of its tokens (the
    stop strings' cut, front/stop.py)."""

    def __init__(self, index: int, job: Job, events: JobEvents, scanner: StopScanner | None) -> None:
        self.index, self.job, self.events, self.scanner = index, job, events, scanner
        self.pushed = 0  # tokens handed to the scanner
        self.used = 0  # once the job is done: how many of its tokens the reply keeps

    def take(self, tokens: list[int]) -> int:
        """Record a batch; how many of its tokens belong to the reply (fewer once a stop string appeared)."""
        if self.scanner is None:
            return len(tokens)
        if self.scanner.stopped:
            return 0
        before = self.scanner.tokens_used
        self.pushed += len(tokens)
        if self.scanner.push(tokens):
            self.job.stopped.set()  # the engine stops at its next step
        return self.scanner.tokens_used - before

    def end(self, tokens: list[int]) -> int:
        """The job is done (`tokens`: all it decided, some perhaps never sent as events); the reply's length."""
        if self.scanner is None:
            self.used = len(tokens)
            return self.used
        if not self.scanner.stopped:
            self.take(tokens[self.pushed:])
        self.scanner.finish()
        self.used = self.scanner.tokens_used
        return self.used

    @property
    def stopped(self) -> bool:
        return self.scanner is not None and self.scanner.stopped


def submit(front: FrontState, service: Service, prepared: Prepared, sampling: Any, head: replies.ReplyHead,
           record: AccessRecord, index: int) -> Choice:
    events = JobEvents(lambda result: record_job(front.metrics, job, result))
    job = Job(prompt=prepared.prompt, max_tokens=prepared.max_tokens, sampling=sampling, events=events,
              rid=head.id if index == 0 else f"{head.id}-{index}", timing=Timing(time.perf_counter(), arrived=record.start))
    service.worker.submit(job)
    return Choice(index, job, events, None)


def record_job(metrics: Metrics, job: Job, result: dict[str, Any]) -> None:
    timing, n = job.timing, len(result["tokens"])
    metrics.generation(len(job.prompt), n, result["stats"], bool(result.get("cancelled")), timing.queue_wait,
                       timing.ttft, timing.decode_rate(n))


class Generation:
    """The submitted jobs of one reply (one per choice) and the reply: awaited whole, or streamed as SSE
    chunks, choice after choice."""

    def __init__(self, service: Service, body: GenerationRequest, choices: list[Choice], record: AccessRecord,
                 head: replies.ReplyHead) -> None:
        self.service, self.body, self.choices, self.record, self.head = service, body, choices, record, head
        for choice in choices:
            choice.scanner = StopScanner(service.text, body.stops) if body.stops else None
        self.logprobs = body.top_logprobs_asked() is not None
        self.finished = False

    def watch(self, request: Request) -> asyncio.Task[None]:
        """A task that cancels the jobs when the client disconnects (the ASGI disconnect message)."""

        async def until_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.cancel()

        return asyncio.ensure_future(until_gone())

    def cancel(self) -> None:
        for choice in self.choices:
            choice.job.cancelled.set()

    def stop(self, watcher: asyncio.Task[None]) -> None:
        watcher.cancel()
        if not self.finished:  # the response was abandoned (client gone, server stopping): so are the jobs
            self.cancel()
            self.record.outcome = 499

    def failure(self, exc: BaseException) -> ApiError:
        self.finished = True
        self.cancel()
        return ApiError(500, f"the engine failed: {type(exc).__name__}: {exc}", code="engine_failed")

    def finish_reason(self, choice: Choice, tokens: list[int]) -> str:
        return "stop" if choice.stopped else self.service.finish_reason(tokens, self.body.sampling())

    def usage(self, first: dict[str, Any], completion: int) -> dict[str, Any]:
        return self.service.usage(len(self.choices[0].job.prompt), first["tokens"], first["stats"], completion)

    async def complete(self, request: Request) -> Response:
        watcher = self.watch(request)
        results = []
        try:
            for choice in self.choices:
                while True:
                    kind, value = await choice.events.get()
                    if kind == "error":
                        raise self.failure(value)
                    if kind == "tokens":
                        choice.take(value)  # a stop string stops the engine early
                        continue
                    results.append(value)
                    break
            self.finished = True
        finally:
            self.stop(watcher)
        if any(r.get("cancelled") for r in results):
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        bodies, completion = [], 0
        for choice, result in zip(self.choices, results):
            tokens = result["tokens"]
            used = choice.end(tokens)
            completion += used
            message = replies.message(self.service.text, tokens[:used])
            if choice.stopped:
                message["content"] = choice.scanner.text
            logprobs = None
            if self.logprobs:
                shaper = LogprobsShaper(self.service.text, self.head.chat)
                logprobs = shaper.shape((result["stats"].get("logprobs") or [])[:used])
            bodies.append(replies.completion_body(self.head, message, self.finish_reason(choice, tokens), {},
                                                  logprobs, choice.index))
        body = bodies[0]
        body["choices"] = [b["choices"][0] for b in bodies]
        body["usage"] = self.usage(results[0], completion)
        return JSONResponse(body)

    async def stream(self, request: Request) -> AsyncIterator[bytes]:
        watcher = self.watch(request)
        first: dict[str, Any] | None = None
        completion = 0
        try:
            for choice in self.choices:
                result = None
                async for item in self.stream_choice(choice):
                    if isinstance(item, dict):
                        result = item
                    else:
                        yield item
                if result is None:  # an error or a disconnect ended the reply
                    return
                first = first or result
                completion += choice.used
            self.finished = True
            if self.body.include_usage and first is not None:
                yield replies.sse(replies.chunk(self.head, None, usage=self.usage(first, completion)))
            yield replies.sse("[DONE]")
        finally:
            self.stop(watcher)

    async def stream_choice(self, choice: Choice) -> AsyncIterator[bytes | dict[str, Any]]:
        """One choice's chunks, then its job's result (a dict); nothing more after an error or a disconnect."""
        i, text = choice.index, self.service.text
        deltas = None if choice.scanner else replies.MessageDeltas(text)
        shaper = LogprobsShaper(text, self.head.chat) if self.logprobs else None
        sent = 0  # tokens whose logprobs went out
        if self.head.chat:
            yield replies.sse(replies.chunk(self.head, {"role": "assistant", "content": ""}, index=i))
        while True:
            kind, value = await choice.events.get()
            if kind == "tokens":
                n = choice.take(value)
                if deltas is not None:
                    out = deltas.push(value)
                else:
                    piece = choice.scanner.releasable()
                    out = [{"content": piece}] if piece else []
                logprobs = None
                if shaper is not None and n:
                    logprobs = shaper.shape(choice.job.logprobs[sent:sent + n])
                    sent += n
                    out = out or [{"content": ""}]
                for delta in out:
                    yield replies.sse(replies.chunk(self.head, delta, index=i, logprobs=logprobs))
                    logprobs = None
                continue
            if kind == "error":
                error = self.failure(value)
                self.record.outcome = 500
                yield replies.sse(error.body())
                return
            if value.get("cancelled"):
                self.finished = True
                self.record.outcome = 499
                return
            tokens = value["tokens"]
            used = choice.end(tokens)
            out = deltas.finish() if deltas is not None else ([{"content": r}] if (r := choice.scanner.rest()) else [])
            for delta in out:
                yield replies.sse(replies.chunk(self.head, delta, index=i))
            logprobs = None
            if shaper is not None and used > sent:  # tokens never handed over as events (a serial eos)
                logprobs = shaper.shape((value["stats"].get("logprobs") or [])[sent:used])
            yield replies.sse(replies.chunk(self.head, {}, self.finish_reason(choice, tokens), index=i,
                                            logprobs=logprobs))
            yield value
            return
