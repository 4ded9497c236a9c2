"""Response bodies and SSE chunks of the OpenAI routes, built from the engine's tokens.

A chat reply's ids are read by GLM's markup parser (front/glm_markup.ReplyParser, set up by a
`ReplySpec`): reasoning, content and tool calls, whole (`chat_message`) or as OpenAI deltas
(`ChatDeltas`); /v1/completions' text is the plain decode (`MessageDeltas`, `message`). Every SSE event
is built by `chunk`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from front.chat import ChatText, IncrementalDecoder
from front.glm_markup import Event, Reply, ReplyParser, ToolCallBegin, openai_delta

Delta = dict[str, Any]  # a chat delta: {"role"?, "content"?, ...}


@dataclass
class ReplyHead:
    """What every body and chunk of one reply repeats."""

    id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def fields(self, streaming: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if streaming else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def completion_body(head: ReplyHead, message: Delta, finish: str, usage: dict[str, Any]) -> dict[str, Any]:
    """The non-streaming reply: a chat message, or a completion's text."""
    choice: dict[str, Any] = ({"index": 0, "message": message} if head.chat else
                              {"index": 0, "text": message.get("content") or ""})
    choice.update(finish_reason=finish, logprobs=None)
    return {**head.fields(streaming=False), "choices": [choice], "usage": usage}


def chunk(head: ReplyHead, delta: Delta | None, finish: str | None = None,
          usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """One SSE chunk: a delta (None: the usage chunk, with no choices), its finish reason, usage."""
    body = head.fields(streaming=True)
    if delta is None:
        return {**body, "choices": [], "usage": usage}
    choice: dict[str, Any] = ({"index": 0, "delta": delta} if head.chat else
                              {"index": 0, "text": delta.get("content") or ""})
    choice.update(finish_reason=finish, logprobs=None)
    return {**body, "choices": [choice]}


def sse(payload: dict[str, Any] | str) -> bytes:
    return b"data: " + (payload if isinstance(payload, str) else json.dumps(payload)).encode() + b"\n\n"


class MessageDeltas:
    """Turns the engine's token batches into message deltas, never splitting a UTF-8 character."""

    def __init__(self, text: ChatText) -> None:
        self._decoder = IncrementalDecoder(text)

    def push(self, tokens: list[int]) -> list[Delta]:
        text = self._decoder.push(tokens)
        return [{"content": text}] if text else []

    def finish(self) -> list[Delta]:
        text = self._decoder.finish()
        return [{"content": text}] if text else []


@dataclass(frozen=True)
class ReplySpec:
    """How a chat reply's ids are read: whether the prompt left the reply inside a thinking block, and
    the calls it may make (name -> parameters schema, glm_markup.ToolPlan.schemas; None: none)."""

    thinking_started: bool
    tools: dict[str, Any] | None

    def parser(self, text: ChatText, id_prefix: str) -> ReplyParser:
        """Call ids are f"{id_prefix}_{index}": pass something unique to the request."""
        return ReplyParser(text.tokenizer, self.thinking_started, self.tools, id_prefix)


class ChatDeltas:
    """A chat reply's token batches as OpenAI deltas: `reasoning_content`, `content` and `tool_calls`
    (a call sent whole once its markup closed: index, id, type and name, then its arguments)."""

    def __init__(self, parser: ReplyParser) -> None:
        self._parser = parser
        self.called = False  # a tool call was sent: the finish reason becomes "tool_calls"

    def push(self, tokens: list[int]) -> list[Delta]:
        return self._deltas(self._parser.push(tokens))

    def finish(self) -> list[Delta]:
        return self._deltas(self._parser.finish())

    def _deltas(self, events: list[Event]) -> list[Delta]:
        self.called = self.called or any(isinstance(e, ToolCallBegin) for e in events)
        return [d for d in map(openai_delta, events) if d is not None]


def chat_message(reply: Reply) -> Delta:
    """The assistant message: content null only when the reply is tool calls alone (as OpenAI sends it)."""
    msg = reply.message()
    if msg["content"] is None and not reply.tool_calls:
        msg["content"] = ""
    return msg


def message(text: ChatText, tokens: list[int]) -> Delta:
    """The whole reply as one assistant message."""
    return {"role": "assistant", "content": text.decode(tokens)}
