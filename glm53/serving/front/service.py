"""The engine side of the front: one engine behind its worker, the checkpoint's text side, and the
steps that turn a validated request into a job (prompt bounds, template, tokenizer, token budget).

`prepare` runs on a small thread pool, off the event loop: a large prompt's template and tokenizer
never hold up /health or other requests, and at most POOL_THREADS of them run at once.
"""
from __future__ import annotations

import hashlib
import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from glm53.serving.front import combos, glm_markup
from glm53.serving.front.chat import ChatText, TemplateArgumentError, TemplateError
from glm53.serving.front.errors import ApiError, bad_request
from glm53.serving.front.replies import ReplySpec
from glm53.serving.front.schemas import ChatCompletionRequest, GenerationRequest
from glm53.serving.front.settings import FrontSettings
from glm53.serving.front.steer import Steer
from glm53.serving.front.worker import EngineWorker

log = logging.getLogger("front.service")
POOL_THREADS = 2


@dataclass
class ChatPrompt:
    ids: list[int]
    reply: ReplySpec
    new_steer: Callable[[], Steer] | None  # a fresh steering state for one choice; None: not steered


@dataclass
class Prepared:
    prompt: list[int]
    max_tokens: int
    samplings: list[Any]  # per choice (n): what sampling_factory made of the request's sampling fields
    reply: ReplySpec | None = None  # chat: how to read the reply; None: plain text (/v1/completions)
    steers: list[Steer | None] = field(default_factory=list)  # per choice: glm53/serving/front/steer.py (None: not steered)

    @property
    def sampling(self) -> Any:
        return self.samplings[0]

    def steer(self, index: int) -> Steer | None:
        return self.steers[index] if self.steers else None


class Service:
    """What the routes serve: the engine (through its worker), the text side and the settings."""

    def __init__(self, engine: Any, text: ChatText, settings: FrontSettings,
                 sampling_factory: Callable[[dict[str, Any]], Any]) -> None:
        self.engine, self.text, self.settings, self.sampling_factory = engine, text, settings, sampling_factory
        self.eos = {int(t) for t in getattr(engine, "eos", []) or []}
        self.fatal: BaseException | None = None
        self.pool = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="prepare")
        self.worker = EngineWorker(engine, self._on_fatal, max_waiting=settings.max_waiting)

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
        self.check_token_ids(fields.get("logit_bias"))
        if chat is not None and chat.new_steer is not None:
            combos.check_steered(request)
            if fields.get("seed") is None:
                fields["seed"] = secrets.randbits(63)  # one seed for every burst: they sample as one reply
            # a later burst's prompt holds the reply so far: the penalties count it from here
            fields["reply_start"] = len(prompt)
        try:
            samplings = [self.sampling_factory(choice) for choice in choice_fields(fields, request.choices)]
        except (ValueError, TypeError) as exc:
            raise bad_request(f"bad sampling parameters: {exc}", getattr(exc, "param", None)) from exc
        if chat is None:
            return Prepared(prompt, max_tokens, samplings)
        # a Steer holds one reply's state: one per choice
        steers = [chat.new_steer() if chat.new_steer else None for _ in samplings]
        return Prepared(prompt, max_tokens, samplings, chat.reply, steers)

    def check_token_ids(self, logit_bias: dict[str, float] | None) -> None:
        vocab = self.text.tokenizer.get_vocab_size(with_added_tokens=True)
        for key in logit_bias or {}:
            if int(key) >= vocab:
                raise bad_request(f"'logit_bias' names token id {key}, outside the vocabulary (size {vocab})",
                                  f"logit_bias.{key}")

    def chat_prompt(self, request: ChatCompletionRequest) -> ChatPrompt:
        """The prompt of a chat request through GLM's markup (glm53/serving/front/glm_markup.py): messages, tools and
        tool_choice, thinking controls; then how to read the reply and how to steer it."""
        tok = self.text.tokenizer
        try:
            plan = glm_markup.plan_tools(request.tools, request.tool_choice)
            thinking = glm_markup.thinking_controls(request.reasoning_effort, combos.template_kwargs(request))
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
        new_steer = None
        if budget is not None or forced or single is not None:
            new_steer = partial(Steer, tok, started, budget, forced, single, self.eos, bool(request.ignore_eos))
        return ChatPrompt(ids, reply, new_steer)

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

    def usage(self, n_prompt: int, tokens: list[int], stats: dict[str, Any], completion: int | None = None) -> dict[str, Any]:
        """The prompt once (n choices share it; cached_tokens: the first choice's), the completion tokens
        of every choice (`completion`, when given, instead of len(tokens))."""
        cached = int(stats.get("cached_tokens", 0) or 0)
        done = len(tokens) if completion is None else completion
        return {"prompt_tokens": n_prompt, "completion_tokens": done,
                "total_tokens": n_prompt + done, "prompt_tokens_details": {"cached_tokens": cached}}

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


def choice_fields(fields: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The sampling fields of each of n choices: choice i samples with derive_seed(seed, i) (choice 0
    with the request's seed), so choices differ and each is reproduced by its seed with n = 1. A
    request without a seed draws one here when n > 1."""
    if n == 1:
        return [fields]
    seed = fields.get("seed")
    base = seed if seed is not None else secrets.randbits(63)
    return [{**fields, "seed": derive_seed(base, i)} for i in range(n)]


def derive_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed: the request's own for choice 0, a hash of (seed, index) for the others."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"glm53-choice:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
