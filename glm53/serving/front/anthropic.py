"""Anthropic's Messages API, POST /v1/messages: the body is translated into the chat request the OpenAI
route serves (glm53/serving/front/anthropic_schemas.py) and runs through the same generation path (glm53/serving/front/app.py:
prompt, job, worker, cancellation, metrics); this module writes the reply as Anthropic sends it.

A reply is content blocks: `thinking` (the reasoning; `signature` empty: there is nothing to verify),
`text` and `tool_use` (id `toolu_<request id>_<n>`, `input` the parsed arguments). Streaming sends
Anthropic's event sequence: message_start, then per block content_block_start, its deltas
(thinking_delta, text_delta, input_json_delta) and content_block_stop, then message_delta (stop_reason,
usage) and message_stop; an engine failure mid-stream is an `error` event. Usage: input_tokens are the
prompt tokens computed for this request, cache_read_input_tokens those the prefix cache supplied (their
sum is the prompt), output_tokens the reply's.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from glm53.serving.front import glm_markup
from glm53.serving.front.access import record_of
from glm53.serving.front.anthropic_schemas import chat_error, parse_messages
from glm53.serving.front.errors import ApiError
from glm53.serving.front.glm_markup import ContentDelta, Event, ReasoningDelta, ToolCallArguments, ToolCallBegin, ToolCallEnd

from glm53.serving.front.generation import Generation, read_body, start_generation
from glm53.serving.front.state import FrontState

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


async def messages(front: FrontState, request: Request) -> Response:
    service = front.serving()
    raw = await read_body(request, service.settings.max_body_bytes)
    record = record_of(request.scope)
    try:
        body, chat = await asyncio.get_running_loop().run_in_executor(service.pool, parse_messages, raw)
        run = await start_generation(front, service, chat, record, "msg_" + record.rid, "toolu_" + record.rid)
    except ApiError as exc:
        raise chat_error(exc) from None
    if body.stream:
        return StreamingResponse(stream(run, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    result = await run.result(request)
    if result is None:
        return Response(status_code=499)  # the client left
    choice = run.choices[0]
    reply = glm_markup.Reply.of(choice.markup_end(result["tokens"]))
    return JSONResponse({**message_head(run), "content": blocks(reply),
                         **stop_fields(run, result, bool(reply.tool_calls)),
                         "usage": usage(run, cached_tokens(result["stats"]), choice.used)})


def stop_fields(run: Generation, result: dict[str, Any], called: bool) -> dict[str, Any]:
    """stop_reason and stop_sequence: "stop_sequence" and the string when one of stop_sequences ended
    the reply, else the finish reason's counterpart."""
    choice = run.choices[0]
    if choice.stopped:
        return {"stop_reason": "stop_sequence", "stop_sequence": choice.matched}
    finish = run.finish_reason(choice, result)
    return {"stop_reason": STOP_REASONS["tool_calls" if called and finish == "stop" else finish],
            "stop_sequence": None}


def message_head(run: Generation) -> dict[str, Any]:
    return {"id": run.head.id, "type": "message", "role": "assistant", "model": run.head.model}


def cached_tokens(stats: dict[str, Any]) -> int:
    return int(stats.get("cached_tokens", 0) or 0)


def usage(run: Generation, cached: int, output: int) -> dict[str, Any]:
    return {"input_tokens": len(run.job.prompt) - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output}


def blocks(reply: glm_markup.Reply) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if reply.reasoning_content:
        out.append({"type": "thinking", "thinking": reply.reasoning_content, "signature": ""})
    if reply.content:
        out.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        out.append({"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)})
    return out


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class BlockStream:
    """glm_markup events -> Anthropic's content block events, each block opened, filled and closed in
    order (a new kind of content closes the block before it)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the kind of the open block
        self.called = False

    def push(self, events: list[Event]) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            if isinstance(e, ReasoningDelta):
                out += self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, ContentDelta):
                out += self._ensure("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, ToolCallBegin):
                self.called = True
                out += self.close()
                out += self._start("tool_use", {"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
            elif isinstance(e, ToolCallArguments):
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.text}))
            elif isinstance(e, ToolCallEnd):
                out += self.close()
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _ensure(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        if self.open == kind:
            return []
        return self.close() + self._start(kind, block)

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        self.index += 1
        self.open = kind
        return [sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                            "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})


async def stream(run: Generation, request: Request) -> AsyncIterator[bytes]:
    choice = run.choices[0]
    out = BlockStream()
    started = False
    async for kind, value in run.events_of(request):
        if kind == "error":
            yield sse("error", value.anthropic_body())
            return
        if not started:  # the first event ("started", or the result of a job that produced nothing)
            started = True
            cached = cached_tokens(value["stats"] if kind == "done" else value)
            yield sse("message_start", {"type": "message_start", "message": {
                **message_head(run), "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": usage(run, cached, 0)}})
        if kind == "markup":
            for chunk in out.push(value):
                yield chunk
        elif kind == "done":
            for chunk in out.push(choice.markup_end(value["tokens"])) + out.close():
                yield chunk
            yield sse("message_delta", {"type": "message_delta", "delta": stop_fields(run, value, out.called),
                                        "usage": usage(run, cached_tokens(value["stats"]), choice.used)})
            yield sse("message_stop", {"type": "message_stop"})
