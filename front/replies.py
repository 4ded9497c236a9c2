"""Response bodies and SSE chunks of the OpenAI routes, built from the engine's tokens.

Token batches become message deltas (`MessageDeltas`: today `{"content": text}`); every SSE event
is built by `chunk`, so that other kinds of delta (reasoning, tool calls) need a producer of deltas
and nothing else.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from front.chat import ChatText, IncrementalDecoder

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


def message(text: ChatText, tokens: list[int]) -> Delta:
    """The whole reply as one assistant message."""
    return {"role": "assistant", "content": text.decode(tokens)}
