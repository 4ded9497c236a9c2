"""Constrained decoding for `response_format` through llguidance (pinned; docs/decisions/grammar-library.md).

`grammar_for(response_format)` turns OpenAI's field into an llguidance grammar string (validated
here, so a bad schema is the request's 400, not a failure inside the engine); the string is what
travels in `SamplingParams.grammar` (to every rank too). `GrammarMatcher` follows one request's
reply token by token: the allowed tokens at the next position, accept, roll back.

JSON is generated compactly (`whitespace_flexible` off: no free whitespace between tokens, which a
model could otherwise repeat until max_tokens); a schema's own `x-guidance` options still apply.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glm53.runtime.errors import SamplingError

JSON_OPTIONS = {"whitespace_flexible": False}
# json_object: any JSON object (OpenAI's JSON mode)
ANY_OBJECT = {"type": "object"}


def grammar_for(response_format: Any) -> str | None:
    """The llguidance grammar for OpenAI's `response_format` (None for {"type": "text"}); raises
    SamplingError naming `response_format` for anything it cannot serve."""
    import llguidance  # native library (~80 ms to load): only requests with a grammar load it

    if not isinstance(response_format, dict):
        raise SamplingError(f"'response_format' must be an object, got {response_format!r}", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = ANY_OBJECT
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise SamplingError("'response_format.json_schema.schema' must be a JSON Schema object",
                                "response_format.json_schema.schema")
    else:
        raise SamplingError(f"'response_format.type' is {kind!r}; this server serves 'text', 'json_object' and "
                            "'json_schema'", "response_format.type")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise SamplingError(f"'response_format' schema cannot be compiled: {exc}", "response_format") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error and not error.startswith("WARNING"):
        raise SamplingError(f"'response_format' schema cannot be served: {error}", "response_format")
    return grammar


@functools.lru_cache(maxsize=4)
def _tokenizer(tokenizer_json: str, vocab_size: int, eos: tuple[int, ...]) -> Any:
    """llguidance's view of the checkpoint's tokenizer (built once a process: ~1 s at GLM's vocabulary)."""
    import llguidance  # native library (~80 ms to load): only requests with a grammar load it

    return llguidance.LLTokenizer(Path(tokenizer_json).read_text(), n_vocab=vocab_size, eos_token=list(eos))


class GrammarError(SamplingError):
    """The grammar matcher failed while a request generated (llguidance's own error): the request's
    failure, not the engine's; the batched runtime ends that request alone."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "response_format")


class GrammarMatcher:
    """One request's position in its grammar. The mask allows the end-of-sequence tokens where the
    grammar may end (and only them once it must)."""

    def __init__(self, grammar: str, model_dir: str | Path, vocab_size: int, eos: tuple[int, ...]) -> None:
        import llguidance  # native library (~80 ms to load): only requests with a grammar load it

        tok_file = Path(model_dir) / "tokenizer.json"
        if not tok_file.is_file():
            raise SamplingError(f"'response_format' needs the checkpoint's tokenizer ({tok_file} is missing)",
                                "response_format")
        self.vocab_size = vocab_size
        self._matcher = llguidance.LLMatcher(_tokenizer(str(tok_file), vocab_size, tuple(eos)), grammar, log_level=0)
        self._kept: list[bool] = []  # per accepted token: whether the matcher consumed it
        self._check()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"grammar matcher failed: {self._matcher.get_error()}")

    def allowed(self) -> torch.Tensor:
        """A bool tensor [vocab]: the tokens the grammar allows at the next position."""
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        self._check()
        return torch.from_numpy(bits[:self.vocab_size].astype(bool))

    def accept(self, token: int) -> None:
        """Advance over `token`. Once the grammar has ended (an end-of-sequence token was taken where
        it had to end) llguidance takes further tokens without keeping them, so they are not consumed:
        a draft source may propose past the end, and the rollback must count only what was kept."""
        if self._matcher.is_stopped():
            self._kept.append(False)
            return
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"grammar matcher refused token {token}: {self._matcher.get_error()}")
        self._kept.append(True)

    def rollback(self, n: int) -> None:
        """Undo the last n accepts."""
        kept = sum(self._kept[len(self._kept) - n:]) if n else 0
        del self._kept[len(self._kept) - n:]
        if kept and not self._matcher.rollback(kept):
            raise GrammarError(f"grammar matcher cannot roll back {kept} tokens: {self._matcher.get_error()}")

