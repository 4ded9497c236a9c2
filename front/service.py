"""The engine side of the front: one engine behind its worker, the checkpoint's text side, and the
steps that turn a validated request into a job (prompt bounds, template, tokenizer, token budget).

`prepare` runs on a small thread pool, off the event loop: a large prompt's template and tokenizer
never hold up /health or other requests, and at most POOL_THREADS of them run at once.
"""
from __future__ import annotations

import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from front import glm_markup
from front.chat import ChatText, TemplateArgumentError, TemplateError
from front.errors import ApiError, bad_request
from front.replies import ReplySpec
from front.schemas import ChatCompletionRequest, GenerationRequest
from front.settings import FrontSettings
from front.steer import Steer
from front.worker import EngineWorker

log = logging.getLogger("front.service")
POOL_THREADS = 2


@dataclass
class ChatPrompt:
    ids: list[int]
    reply: ReplySpec
    steer: Steer | None


@dataclass
class Prepared:
    prompt: list[int]
    max_tokens: int
    sampling: Any  # what sampling_factory made of the request's sampling fields
    reply: ReplySpec | None = None  # chat: how to read the reply; None: plain text (/v1/completions)
    steer: Steer | None = None  # chat: the ids the front appends and where bursts end (front/steer.py)


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
        field = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
        size, limit = request.text_bytes(), self.settings.max_prompt_bytes
        if size > limit:
            raise bad_request(f"the prompt has {size} bytes of text; the context of {self.settings.context} tokens "
                              f"holds at most {limit} ({self.settings.prompt_bytes_per_token} bytes a token)",
                              field, "context_length_exceeded")
        chat = self.chat_prompt(request) if isinstance(request, ChatCompletionRequest) else None
        prompt = chat.ids if chat is not None else self.prompt_ids(request)
        max_tokens = self.budget(request, len(prompt))
        fields = request.sampling()
        if chat is not None and chat.steer is not None and fields.get("seed") is None:
            fields["seed"] = secrets.randbits(63)  # one seed for every burst: they sample as one reply
        try:
            sampling = self.sampling_factory(fields)
        except (ValueError, TypeError) as exc:
            raise bad_request(f"bad sampling parameters: {exc}") from exc
        if chat is None:
            return Prepared(prompt, max_tokens, sampling)
        return Prepared(prompt, max_tokens, sampling, chat.reply, chat.steer)

    def chat_prompt(self, request: ChatCompletionRequest) -> ChatPrompt:
        """The prompt of a chat request through GLM's markup (front/glm_markup.py): messages, tools and
        tool_choice, thinking controls; then how to read the reply and how to steer it."""
        tok = self.text.tokenizer
        try:
            plan = glm_markup.plan_tools(request.tools, request.tool_choice)
            thinking = glm_markup.thinking_controls(request.reasoning_effort, request.chat_template_kwargs)
            messages = glm_markup.render_messages(request.markup_messages())
            forced = glm_markup.forced_call_ids(plan, tok)
        except glm_markup.MarkupError as exc:
            raise bad_request(str(exc), exc.param) from exc
        except ValueError as exc:  # a tokenizer without GLM's tool markup cannot force a call
            raise bad_request(str(exc), "tool_choice") from exc
        try:
            rendered = self.text.render(messages, plan.render, thinking.template_kwargs)
        except TemplateArgumentError as exc:
            raise bad_request(str(exc), "chat_template_kwargs") from exc
        except (TemplateError, TypeError) as exc:  # a TypeError: content the template cannot handle
            raise bad_request(f"chat template failed: {exc}" if isinstance(exc, TypeError) else str(exc),
                              "messages") from exc
        ids = self._encode(rendered, "messages")
        ids += glm_markup.close_thinking(ids, thinking.enabled, tok)
        started = glm_markup.thinking_open(ids, tok)
        reply = ReplySpec(started, plan.schemas)
        budget = request.thinking_budget if started else None
        single = plan.schemas if request.parallel_tool_calls is False else None
        steer = None
        if budget is not None or forced or single is not None:
            sampling = request.sampling()
            steer = Steer(tok, started, budget, forced, single, self.eos, bool(sampling.get("ignore_eos")))
        return ChatPrompt(ids, reply, steer)

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        if isinstance(request, ChatCompletionRequest):
            return self.chat_prompt(request).ids
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
        memory = getattr(self.engine, "memory", None)  # rank 0's weights on the device (glm53.model.memory)
        if memory is not None:
            body["memory"] = memory
        return body

    def refuse_if_failed(self) -> None:
        if self.fatal is not None:
            raise ApiError(503, f"the engine failed: {type(self.fatal).__name__}: {self.fatal}", code="engine_failed")
