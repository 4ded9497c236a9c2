"""Response bodies and SSE chunks of the OpenAI routes, built from the engine's tokens.

A chat reply's ids are read by GLM's markup parser (glm53/serving/front/glm_markup.ReplyParser, set up by a
`ReplySpec`): reasoning, content and tool calls, whole (`chat_message`) or as OpenAI deltas
(`ChoiceDeltas`); /v1/completions' text is the plain decode (`MessageDeltas`). Every SSE event
is built by `chunk`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from glm53.serving.front.chat import ChatText, IncrementalDecoder
from glm53.serving.front.glm_markup import Event, Reply, ReplyParser, ToolCallBegin, openai_delta

if TYPE_CHECKING:
    from glm53.serving.front.choice import Choice

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


def completion_body(head: ReplyHead, message: Delta, finish: str, usage: dict[str, Any],
                    logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    """The non-streaming reply: a chat message, or a completion's text (choice `index` of n)."""
    choice: dict[str, Any] = ({"index": index, "message": message} if head.chat else
                              {"index": index, "text": message.get("content") or ""})
    choice.update(finish_reason=finish, logprobs=logprobs)
    return {**head.fields(streaming=False), "choices": [choice], "usage": usage}


def chunk(head: ReplyHead, delta: Delta | None, finish: str | None = None,
          usage: dict[str, Any] | None = None, index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One SSE chunk: a delta of choice `index` (None: the usage chunk, with no choices), its finish
    reason, its tokens' logprobs, usage."""
    body = head.fields(streaming=True)
    if delta is None:
        return {**body, "choices": [], "usage": usage}
    choice: dict[str, Any] = ({"index": index, "delta": delta} if head.chat else
                              {"index": index, "text": delta.get("content") or ""})
    choice.update(finish_reason=finish, logprobs=logprobs)
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


class ChoiceDeltas:
    """One choice's token batches as deltas, after `Choice.take` saw them: a chat reply's markup events
    as OpenAI deltas (`reasoning_content`, `content`, `tool_calls`: a call sent whole once its markup
    closed), else the plain text (up to a stop string: the scanner's releasable text)."""

    def __init__(self, choice: Choice, text: ChatText) -> None:
        self._choice = choice
        self._plain = MessageDeltas(text) if choice.parser is None and choice.scanner is None else None
        self.called = False  # a tool call was sent: the finish reason becomes "tool_calls"

    def push(self, tokens: list[int]) -> list[Delta]:
        choice = self._choice
        if choice.parser is not None:
            return self._deltas(choice.markup(tokens))
        if self._plain is not None:
            return self._plain.push(tokens)
        piece = choice.scanner.releasable()
        return [{"content": piece}] if piece else []

    def finish(self, tokens: list[int]) -> list[Delta]:
        """The rest once `Choice.end` ran (`tokens`: all the job decided)."""
        choice = self._choice
        if choice.parser is not None:
            return self._deltas(choice.markup_end(tokens))
        if self._plain is not None:
            return self._plain.finish()
        rest = choice.scanner.rest()
        return [{"content": rest}] if rest else []

    def _deltas(self, events: list[Event]) -> list[Delta]:
        self.called = self.called or any(isinstance(e, ToolCallBegin) for e in events)
        return [d for d in map(openai_delta, events) if d is not None]


def chat_message(reply: Reply) -> Delta:
    """The assistant message: content null only when the reply is tool calls alone (as OpenAI sends it)."""
    msg = reply.message()
    if msg["content"] is None and not reply.tool_calls:
        msg["content"] = ""
    return msg
