"""One streamed chat completion, timed: the first and last chunk that carry generated text, and
the token counts from the final usage chunk (`stream_options: {"include_usage": true}`): chunks
are never counted as tokens, since a server may pack several tokens into one."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from glm53.apibench.endpoint import BenchError, Endpoint, named_failures
from glm53.apibench.schema import RequestTiming


@dataclass
class Reply:
    text: str
    timing: RequestTiming
    started: float  # time.perf_counter() when the request was sent
    ended: float  # ... when the stream ended


def _generated(delta: Any) -> str:
    """The text a chunk's delta carries: content, or reasoning text where a server streams it apart
    (both are generated tokens), or a tool call's arguments."""
    extra = delta.model_extra or {}
    parts = [delta.content, extra.get("reasoning_content"), extra.get("reasoning")]
    for call in delta.tool_calls or []:
        if call.function is not None:
            parts.append(call.function.arguments)
    return "".join(p for p in parts if isinstance(p, str))


def _still_there(endpoint: Endpoint, what: str) -> None:
    """After a stream that ended without usage: a server that went away mid-stream (the SDK ends such
    a stream quietly) is named as gone rather than as one that sends no usage."""
    with named_failures(endpoint.base, f"GET /v1/models after the stream of {what} ended early"):
        endpoint.client.models.list()


def chat(endpoint: Endpoint, messages: list[dict[str, Any]], max_tokens: int, what: str,
         extra_body: dict[str, Any] | None = None) -> Reply:
    """Send one temperature-0 streamed request; raise BenchError naming the URL when the server
    fails, answers badly, or sends no usage."""
    text: list[str] = []
    first = last = None
    finish = None
    usage = None
    with named_failures(endpoint.base, what):
        started = time.perf_counter()
        with endpoint.client.chat.completions.create(
                model=endpoint.model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body=extra_body or None) as stream:
            for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    piece = _generated(choice.delta)
                    if piece:
                        first = now if first is None else first
                        last = now
                        text.append(piece)
                    finish = choice.finish_reason or finish
        ended = time.perf_counter()
    if usage is None:
        _still_there(endpoint, what)
        raise BenchError(f"{endpoint.base} sent no usage for {what}: the stream must end with a usage chunk "
                         f"(stream_options include_usage); tokens are counted from usage, never from chunks")
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else None
    n = usage.completion_tokens
    decode = (n - 1) / (last - first) if first is not None and last is not None and n >= 2 and last > first else None
    timing = RequestTiming(prompt_tokens=usage.prompt_tokens, completion_tokens=n, cached_tokens=cached,
                           ttft_s=None if first is None else first - started, wall_s=ended - started,
                           decode_tok_s=decode, finish_reason=finish)
    return Reply("".join(text), timing, started, ended)
