"""A generation once its route has read the body: the prompt, one job per choice on the engine's
worker, and the reply, awaited whole or streamed as SSE. The routes of both APIs (app.py, anthropic.py)
share it."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from glm53.runtime.errors import SamplingError
from glm53.serving.front import glm_markup, replies
from glm53.serving.front.access import AccessRecord
from glm53.serving.front.choice import Choice
from glm53.serving.front.errors import ApiError
from glm53.serving.front.logprobs import LogprobsShaper
from glm53.serving.front.metrics import Metrics
from glm53.serving.front.observe import Timing
from glm53.serving.front.schemas import ChatCompletionRequest, GenerationRequest
from glm53.serving.front.service import Prepared, Service
from glm53.serving.front.state import FrontState
from glm53.serving.front.stop import StopScanner
from glm53.serving.front.worker import Job

# what a JSON body may be labelled; curl -d sends form-urlencoded unless told otherwise
JSON_TYPES = ("", "application/json", "text/plain", "application/x-www-form-urlencoded")


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


async def start_generation(front: FrontState, service: Service, body: GenerationRequest, record: AccessRecord,
                           reply_id: str, call_prefix: str) -> "Generation":
    """The path every generation route shares once its body is a GenerationRequest: the model's name,
    the prompt (on the pool), one job per choice on the engine's worker (queued together: the engine
    decodes them one after another). Choice i's tool-call ids start f"{call_prefix}-{i}" (i > 0)."""
    if body.model not in (None, service.settings.served_model):
        raise unknown_model(body.model, service, "model")
    prepared: Prepared = await asyncio.get_running_loop().run_in_executor(service.pool, service.prepare, body)
    head = replies.ReplyHead(reply_id, service.settings.served_model, isinstance(body, ChatCompletionRequest))
    choices: list[Choice] = []
    for i, sampling in enumerate(prepared.samplings):
        suffix = "" if i == 0 else f"-{i}"
        events = JobEvents(lambda result, i=i: record_job(front.metrics, choices[i].job, result))
        job = Job(prompt=prepared.prompt, max_tokens=prepared.max_tokens, sampling=sampling, events=events,
                  rid=head.id + suffix, timing=Timing(time.perf_counter(), arrived=record.start),
                  steer=prepared.steer(i))
        scanner = StopScanner(service.text, body.stops) if body.stops else None
        parser = prepared.reply.parser(service.text, call_prefix + suffix) if prepared.reply is not None else None
        choices.append(Choice(i, job, events, scanner, parser))
    for choice in choices:
        service.worker.submit(choice.job)
    return Generation(service, body, choices, record, head)


def record_job(metrics: Metrics, job: Job, result: dict[str, Any]) -> None:
    timing, n = job.timing, len(result["tokens"])
    metrics.generation(len(job.prompt), n, result["stats"], bool(result.get("cancelled")), timing.queue_wait,
                       timing.ttft, timing.decode_rate(n))


class Generation:
    """The submitted jobs of one reply (one per choice) and the reply: awaited whole, or streamed as SSE
    chunks, choice after choice. The OpenAI bodies and chunks are built here (`complete`, `stream`);
    other APIs read choice 0 through `result` and `events_of` (glm53/serving/front/anthropic.py)."""

    def __init__(self, service: Service, body: GenerationRequest, choices: list[Choice], record: AccessRecord,
                 head: replies.ReplyHead) -> None:
        self.service, self.body, self.choices, self.record, self.head = service, body, choices, record, head
        self.logprobs = body.top_logprobs_asked() is not None
        self.finished = False

    @property
    def job(self) -> Job:
        return self.choices[0].job

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
        if isinstance(exc, SamplingError):  # this request's own sampling (its grammar) failed; the lane serves on
            return ApiError(500, f"the request failed while generating: {exc}", param=exc.param, code="request_failed")
        return ApiError(500, f"the engine failed: {type(exc).__name__}: {exc}", code="engine_failed")

    def finish_reason(self, choice: Choice, result: dict[str, Any]) -> str:
        """"stop" (a stop string, the model's end, the steering's one-call rule) or "length", before
        tool calls turn "stop" into "tool_calls"."""
        if choice.stopped or result.get("steer_ended"):
            return "stop"
        return self.service.finish_reason(result["tokens"], self.body.sampling())

    def usage(self, first: dict[str, Any], completion: int) -> dict[str, Any]:
        return self.service.usage(len(self.job.prompt), first["tokens"], first["stats"], completion)

    async def result(self, request: Request) -> dict[str, Any] | None:
        """Choice 0's result once its job is done, `end` applied (None: the client left); an engine
        failure raises a 500."""
        watcher = self.watch(request)
        choice = self.choices[0]
        try:
            value = await self.done(choice)
            self.finished = True
        finally:
            self.stop(watcher)
        if value.get("cancelled"):
            return None
        choice.end(value["tokens"])
        return value

    async def done(self, choice: Choice) -> dict[str, Any]:
        """A choice's job result, its token batches handed to the choice as they come (a stop string
        stops the engine early); an engine failure raises a 500."""
        while True:
            kind, value = await choice.events.get()
            if kind == "error":
                raise self.failure(value)
            if kind == "tokens":
                choice.take(value)
            if kind == "done":
                return value

    async def events_of(self, request: Request) -> AsyncIterator[tuple[str, Any]]:
        """Choice 0's events as they come: ("started", counts), ("markup", parser events of a batch),
        then ("done", the result, `end` applied) or ("error", the ApiError to send); nothing after a
        cancelled job's end. The client's disconnect is watched meanwhile."""
        watcher = self.watch(request)
        choice = self.choices[0]
        try:
            while True:
                kind, value = await choice.events.get()
                if kind == "error":
                    self.record.outcome = 500
                    yield kind, self.failure(value)
                    return
                if kind == "tokens":
                    choice.take(value)
                    yield "markup", choice.markup(value)
                    continue
                if kind == "done":
                    self.finished = True
                    if value.get("cancelled"):
                        self.record.outcome = 499
                        return
                    choice.end(value["tokens"])
                yield kind, value
                if kind == "done":
                    return
        finally:
            self.stop(watcher)

    async def complete(self, request: Request) -> Response:
        watcher = self.watch(request)
        results = []
        try:
            for choice in self.choices:
                results.append(await self.done(choice))
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
            finish = self.finish_reason(choice, result)
            if choice.parser is not None:
                reply = glm_markup.Reply.of(choice.markup_end(tokens))
                message, finish = replies.chat_message(reply), reply.finish_reason(finish)
            else:
                message = {"role": "assistant",
                           "content": choice.scanner.text if choice.scanner else self.service.text.decode(tokens)}
            logprobs = None
            if self.logprobs:
                shaper = LogprobsShaper(self.service.text, self.head.chat)
                logprobs = shaper.shape((result["stats"].get("logprobs") or [])[:used])
            bodies.append(replies.completion_body(self.head, message, finish, {}, logprobs, choice.index))
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
        texts = replies.ChoiceDeltas(choice, text)
        shaper = LogprobsShaper(text, self.head.chat) if self.logprobs else None
        sent = 0  # tokens whose logprobs went out
        if self.head.chat:
            yield replies.sse(replies.chunk(self.head, {"role": "assistant", "content": ""}, index=i))
        while True:
            kind, value = await choice.events.get()
            if kind == "started":
                continue
            if kind == "tokens":
                n = choice.take(value)
                out = texts.push(value)
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
            for delta in texts.finish(tokens):
                yield replies.sse(replies.chunk(self.head, delta, index=i))
            logprobs = None
            if shaper is not None and used > sent:  # tokens never handed over as events (a serial eos)
                logprobs = shaper.shape((value["stats"].get("logprobs") or [])[sent:used])
            finish = self.finish_reason(choice, value)
            if texts.called and finish == "stop":
                finish = "tool_calls"
            yield replies.sse(replies.chunk(self.head, {}, finish, index=i, logprobs=logprobs))
            yield value
            return
