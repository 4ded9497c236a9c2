"""The request bodies of /v1/chat/completions and /v1/completions as pydantic models.

Strict types (a number is not a string, a flag is not a number); every refusal becomes a 400 naming
the field (`param`, as `messages[0].role`). Fields the models do not declare are kept, not refused
(`model_extra`), so that what a later part of the front reads (tool-call and thinking options, say)
reaches it unchanged.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from front.errors import ApiError, bad_request, param_of

MODEL_CONFIG = ConfigDict(strict=True, extra="allow")


def refusal(message: str, at: str = "") -> PydanticCustomError:
    """A validation error with its own message; `at` extends the field path pydantic reports."""
    return PydanticCustomError("front_refusal", message, {"at": at})


class StreamOptions(BaseModel):
    model_config = MODEL_CONFIG
    include_usage: bool | None = None


class ChatMessage(BaseModel):
    """One message; `content` is text: a string, or OpenAI's text parts joined."""

    model_config = MODEL_CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str

    @model_validator(mode="before")
    @classmethod
    def _text_content(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw  # pydantic refuses it as "a valid dictionary"
        content = raw.get("content")
        if isinstance(content, list):  # content parts: only text is served
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise refusal('must be a text part ({"type": "text", "text": ...}); this model reads text only',
                                  f".content[{j}]")
                texts.append(part["text"])
            return {**raw, "content": "".join(texts)}
        if content is None and raw.get("role") == "assistant" and raw.get("tool_calls"):
            return {**raw, "content": ""}
        if "content" in raw and not isinstance(content, str):
            raise refusal("must be a string or a list of text parts", ".content")
        return raw


class GenerationBody(BaseModel):
    """What both routes share: the model, length, sampling and streaming fields."""

    model_config = MODEL_CONFIG
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=2**31)
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-2**63, le=2**64 - 1)
    draft: bool | None = None  # false: decode without speculative drafts (same text)
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Any = None
    stop: Any = None
    echo: Any = None
    # Accepted so that clients sending them are served, but not applied by this front yet (the
    # reply is what it would be without them).
    user: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    response_format: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: Any) -> Any:
        if value not in (None, 1) or isinstance(value, bool):
            raise refusal("'n' must be 1: this front serves one choice per request")
        return value

    @field_validator("stop")
    @classmethod
    def _no_stop(cls, value: Any) -> Any:
        if value not in (None, [], ""):
            raise refusal("'stop' is not supported by this front; generation stops at the model's end-of-sequence "
                          "token or max_tokens")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: Any) -> Any:
        if value:
            raise refusal("'echo' is not supported by this front")
        return value

    @model_validator(mode="after")
    def _one_length(self) -> "GenerationBody":
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise refusal("'max_tokens' and 'max_completion_tokens' disagree; send one", "max_completion_tokens")
        return self

    @property
    def new_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self) -> dict[str, Any]:
        """The fields the engine's sampling reads, as sent (top_k -1, vLLM's "off", is 0)."""
        out = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "seed", "draft",
                                                      "ignore_eos") if getattr(self, name) is not None}
        if out.get("top_k") == -1:
            out["top_k"] = 0
        return out


class ChatCompletionRequest(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # tools, tool_choice and the thinking controls are checked by front/glm_markup.py (plan_tools,
    # thinking_controls, render_messages), which names the offending field
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Any = None
    thinking_budget: int | None = Field(None, ge=0, le=2**31)  # thinking tokens, then the front closes it

    def markup_messages(self) -> list[dict[str, Any]]:
        """The messages as sent (role, text content, tool_calls, tool_call_id, reasoning), for
        glm_markup.render_messages."""
        return [{**(m.model_extra or {}), "role": m.role, "content": m.content} for m in self.messages]

    def text_bytes(self) -> int:
        """UTF-8 bytes of the text the template renders: messages (their calls and reasoning too) and
        tool definitions."""
        total = sum(_utf8_len(m.content) for m in self.messages)
        total += sum(len(json.dumps(m.model_extra, ensure_ascii=False).encode()) for m in self.messages
                     if m.model_extra)
        return total + (len(json.dumps(self.tools, ensure_ascii=False).encode()) if self.tools else 0)


CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "reasoning_effort", "thinking_budget")


class CompletionRequest(GenerationBody):
    prompt: str | list[int]

    @model_validator(mode="after")
    def _no_chat_fields(self) -> "CompletionRequest":
        for name in CHAT_ONLY:  # a raw prompt has no template to render tools or thinking into
            if (self.model_extra or {}).get(name) is not None:
                raise refusal(f"'{name}' applies to /v1/chat/completions only", name)
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            value = value[0]
        if isinstance(value, str):
            if not value:
                raise refusal("'prompt' is empty")
            return value
        if isinstance(value, list) and value and all(type(t) is int and t >= 0 for t in value):
            return value
        raise refusal("'prompt' must be a non-empty string or a list of token ids")

    def text_bytes(self) -> int:
        return _utf8_len(self.prompt) if isinstance(self.prompt, str) else 0


GenerationRequest = ChatCompletionRequest | CompletionRequest


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))  # a lone surrogate is refused later, by the tokenizer


def parse(raw: bytes, model: type[ChatCompletionRequest] | type[CompletionRequest]) -> GenerationRequest:
    """Validate a body for the route whose request model is `model`; raises ApiError 400."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> ApiError:
    """The first of pydantic's errors as a 400 naming the field."""
    error = exc.errors(include_url=False)[0]
    ctx = error.get("ctx") or {}
    param = param_of(tuple(error["loc"]), ctx.get("at", "") if error["type"] == "front_refusal" else "")
    if error["type"] == "front_refusal":
        message = error["msg"] if error["msg"].startswith("'") else f"'{param}' {error['msg']}"
    else:
        got = repr(error.get("input"))
        message = f"'{param}': {error['msg']}" + (f" (got {got})" if error["type"] != "missing" and len(got) <= 80 else "")
    return bad_request(message, param)
