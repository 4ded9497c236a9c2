"""`logprobs` in the replies: the engine's records (glm53.runtime.logits_policy.TokenLogprob: the model's
log_softmax of the raw logits) in OpenAI's two shapes, chat (`content`: token, logprob, bytes,
top_logprobs) and legacy completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

A token's bytes come from llguidance's view of the tokenizer, exact for byte-level and byte-fallback
vocabularies alike; its text is those bytes as UTF-8 (a token holding part of a character shows the
replacement character there, and `bytes` has the truth).
"""
from __future__ import annotations

import math
import threading
from typing import Any, Sequence

from glm53.serving.front.chat import ChatText

_lock = threading.Lock()
_views: dict[int, Any] = {}


def _bytes_view(text: ChatText) -> Any:
    with _lock:
        view = _views.get(id(text))
        if view is None:
            import llguidance  # native library (~80 ms to load): only requests with a grammar load it

            view = _views[id(text)] = llguidance.LLTokenizer(text.tokenizer.to_str())
        return view


class TokenText:
    """Token id -> (text, bytes) for one checkpoint's tokenizer."""

    def __init__(self, text: ChatText) -> None:
        self._view = _bytes_view(text)

    def bytes(self, token: int) -> bytes:
        return bytes(self._view.decode_bytes([int(token)]))

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="replace")


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0  # JSON has no -inf; OpenAI's floor for "never"


def chat_logprobs(names: TokenText, records: Sequence[Any]) -> dict[str, Any]:
    """The chat shape: {"content": [...], "refusal": None}."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        raw = names.bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(raw)}

    return {"content": [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                        for r in records], "refusal": None}


def completion_logprobs(names: TokenText, records: Sequence[Any], offset: int = 0) -> dict[str, Any]:
    """The legacy shape; `offset`: where the first token's text starts in the reply's text."""
    tokens, offsets = [], []
    for r in records:
        offsets.append(offset)
        tokens.append(names.text(r.token))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [_finite(r.logprob) for r in records],
            "top_logprobs": [{names.text(t): _finite(lp) for t, lp in r.top} for r in records],
            "text_offset": offsets}


class LogprobsShaper:
    """A reply's logprobs in its route's shape; streaming keeps the legacy text offsets running."""

    def __init__(self, text: ChatText, chat: bool) -> None:
        self.names, self.chat, self._offset = TokenText(text), chat, 0

    def shape(self, records: Sequence[Any]) -> dict[str, Any]:
        if self.chat:
            return chat_logprobs(self.names, records)
        body = completion_logprobs(self.names, records, self._offset)
        self._offset += sum(len(t) for t in body["tokens"])
        return body
