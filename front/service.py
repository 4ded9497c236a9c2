"""The engine side of the front: one engine behind its worker, the checkpoint's text side, and the
steps that turn a validated request into a job (prompt bounds, template, tokenizer, token budget).

`prepare` runs on a small thread pool, off the event loop: a large prompt's template and tokenizer
never hold up /health or other requests, and at most POOL_THREADS of them run at once.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from front.chat import ChatText, TemplateArgumentError, TemplateError
from front.errors import ApiError, bad_request
from front.schemas import ChatCompletionRequest, GenerationRequest
from front.settings import FrontSettings
from front.worker import EngineWorker

log = logging.getLogger("front.service")
POOL_THREADS = 2


@dataclass
class Prepared:
    prompt: list[int]
    max_tokens: int
    sampling: Any  # what sampling_factory made of the request's sampling fields


class Service:
    """What the routes serve: the engine (through its worker), the text side and the settings."""

    def __init__(self, engine: Any, text: ChatText, settings: FrontSettings,
                 sampling_factory: Callable[[dict[str, Any]], Any]) -> None:
        self.engine, self.text, self.settings, self.sampling_factory = engine, text, settings, sampling_factory
        self.eos = {int(t) for t in getattr(engine, "eos", []) or []}
        self.fatal: BaseException | None = None
        self.pool = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="prepare")
        self.worker = EngineWorker(engine, self._on_fatal)

    def _on_fatal(self, exc: BaseException) -> None:
        self.fatal = exc
        log.error("engine failed (%s: %s); stopping the lane", type(exc).__name__, exc)

    def close(self) -> None:
        self.worker.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- request preparation (on the pool) ----------------------------------------------------
    def prepare(self, request: GenerationRequest) -> Prepared:
        """Bounds first (bytes of text, then tokens), so that a prompt that cannot fit is refused before
        the template and the tokenizer spend time and memory on it."""
        chat = isinstance(request, ChatCompletionRequest)
        field = "messages" if chat else "prompt"
        size, limit = request.text_bytes(), self.settings.max_prompt_bytes
        if size > limit:
            raise bad_request(f"the prompt has {size} bytes of text; the context of {self.settings.context} tokens "
                              f"holds at most {limit} ({self.settings.prompt_bytes_per_token} bytes a token)",
                              field, "context_length_exceeded")
        prompt = self.prompt_ids(request)
        max_tokens = self.budget(request, len(prompt))
        try:
            sampling = self.sampling_factory(request.sampling())
        except (ValueError, TypeError) as exc:
            raise bad_request(f"bad sampling parameters: {exc}") from exc
        return Prepared(prompt, max_tokens, sampling)

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        if isinstance(request, ChatCompletionRequest):
            try:
                rendered = self.text.render(request.template_messages(), request.tools,
                                            request.chat_template_kwargs)
            except TemplateArgumentError as exc:
                raise bad_request(str(exc), "chat_template_kwargs") from exc
            except (TemplateError, TypeError) as exc:  # a TypeError: content the template cannot handle
                raise bad_request(f"chat template failed: {exc}" if isinstance(exc, TypeError) else str(exc),
                                  "messages") from exc
            return self._encode(rendered, "messages")
        if isinstance(request.prompt, list):
            vocab = self.text.tokenizer.get_vocab_size(with_added_tokens=True)
            bad = [t for t in request.prompt if t >= vocab]
            if bad:
                raise bad_request(f"'prompt' has token id {bad[0]} outside the vocabulary (size {vocab})", "prompt")
            return list(request.prompt)
        return self._encode(request.prompt, "prompt")

    def _encode(self, text: str, field: str) -> list[int]:
        """Token ids of text the request brought; text the tokenizer refuses (a lone UTF-16
        surrogate from a JSON escape, say) is the request's error, not the server's."""
        try:
            return self.text.encode(text)
        except (TypeError, ValueError) as exc:
            raise bad_request(f"the text cannot be tokenized ({exc}); send valid Unicode", field) from exc

    def budget(self, request: GenerationRequest, n_prompt: int) -> int:
        """max_tokens for this request; refuses (400, with the limits) what the context cannot hold."""
        context = self.settings.context
        asked = request.new_tokens
        field = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
        if n_prompt == 0:
            raise bad_request("the prompt encodes to no tokens", field)
        max_tokens = asked if asked is not None else min(self.settings.default_max_tokens, context - n_prompt)
        if n_prompt >= context or n_prompt + max_tokens > context:
            raise bad_request(
                f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens if asked is not None else 'unset'}; "
                f"together they must fit the context of {context} tokens "
                f"(at most {max(context - n_prompt, 0)} new tokens for this prompt)",
                "max_tokens" if n_prompt < context else field, "context_length_exceeded")
        return max_tokens

    # ---- replies -------------------------------------------------------------------------------
    def finish_reason(self, tokens: list[int], sampling: dict[str, Any]) -> str:
        if tokens and tokens[-1] in self.eos and not sampling.get("ignore_eos"):
            return "stop"
        return "length"

    def usage(self, n_prompt: int, tokens: list[int], stats: dict[str, Any]) -> dict[str, Any]:
        cached = int(stats.get("cached_tokens", 0) or 0)
        return {"prompt_tokens": n_prompt, "completion_tokens": len(tokens),
                "total_tokens": n_prompt + len(tokens), "prompt_tokens_details": {"cached_tokens": cached}}

    def health(self) -> dict[str, Any]:
        body = {"status": "ok" if self.fatal is None else "failed", "model": self.settings.served_model,
                "ranks": self.settings.ranks, "context": self.settings.context,
                "prefix_cache": self.settings.prefix_cache, "drafting": self.settings.drafting,
                "prefill_chunk": self.settings.prefill_chunk, "queue_depth": self.worker.depth()}
        runtime = self.worker.runtime_stats()
        if runtime is not None:  # the batched runtime: sequences running together, and those queued
            body["running"], body["waiting"] = runtime["running"], runtime["waiting"]
        memory = getattr(self.engine, "memory", None)  # rank 0's weights on the device (glm53.model.memory)
        if memory is not None:
            body["memory"] = memory
        return body

    def refuse_if_failed(self) -> None:
        if self.fatal is not None:
            raise ApiError(503, f"the engine failed: {type(self.fatal).__name__}: {self.fatal}", code="engine_failed")
