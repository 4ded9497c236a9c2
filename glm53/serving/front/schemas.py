"""The request bodies of /v1/chat/completions and /v1/completions as pydantic models.

Strict types (a number is not a string, a flag is not a number); every refusal becomes a 400 naming
the field (`param`, as `messages[0].role`). Fields the models do not declare are kept, not refused
(`model_extra`), so that what a later part of the front reads (tool-call and thinking options, say)
reaches it unchanged.
"""
from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from glm53.serving.front.errors import ApiError, bad_request, param_of

MODEL_CONFIG = ConfigDict(strict=True, extra="allow")


def refusal(message: str, at: str = "") -> PydanticCustomError:
    """A validation error with its own message; `at` extends the field path pydantic reports."""
    return PydanticCustomError("front_refusal", message, {"at": at})


class StreamOptions(BaseModel):
    model_config = MODEL_CONFIG
    include_usage: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = MODEL_CONFIG
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the grammar always holds the schema; strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise refusal("'response_format.json_schema' is required with type 'json_schema'", ".json_schema")
        return self

    def engine_form(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": self.type}
        if self.json_schema is not None:
            body["json_schema"] = {"name": self.json_schema.name, "schema": self.json_schema.schema_}
        return body


MAX_CHOICES = 16  # n: choices decode one after another on the one engine
MAX_STOPS, MAX_STOP_CHARS = 4, 256
MAX_TOP_LOGPROBS = 20


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
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    echo: Any = None
    # the per-request logits processing (glm53/runtime/logits_policy.py); docs/API.md
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # Accepted and ignored: they cannot change the reply (docs/API.md)
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prediction: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise refusal("'stop' must be a string or a list of strings")
        stops = [s for s in stops if s]  # an empty string never matches: OpenAI's clients send "" for none
        if len(stops) > MAX_STOPS:
            raise refusal(f"'stop' has {len(stops)} strings; at most {MAX_STOPS}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise refusal(f"'stop' strings must be at most {MAX_STOP_CHARS} characters")
        return stops or None

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise refusal(f"'logit_bias' keys are token ids; {key!r} is not one", f".{key}")
            if not -100 <= bias <= 100:
                raise refusal(f"'logit_bias' values lie in [-100, 100]; {key!r} has {bias}", f".{key}")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: Any) -> Any:
        if value:
            raise refusal("'echo' is not supported by this front: drop it (a reply never repeats its prompt)")
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

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    def top_logprobs_asked(self) -> int | None:
        """None: no logprobs; k: the chosen token's and the k most likely (the routes' own fields)."""
        return None

    def sampling(self) -> dict[str, Any]:
        """The fields the engine's sampling reads, as sent (top_k -1, vLLM's "off", is 0)."""
        out = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "seed", "draft",
                                                      "ignore_eos", "frequency_penalty", "presence_penalty",
                                                      "repetition_penalty", "logit_bias") if getattr(self, name) is not None}
        if out.get("top_k") == -1:
            out["top_k"] = 0
        if self.response_format is not None and self.response_format.type != "text":
            out["response_format"] = self.response_format.engine_form()
        if self.top_logprobs_asked() is not None:
            out["logprobs"] = self.top_logprobs_asked()
        return out


class ChatCompletionRequest(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # tools, tool_choice and the thinking controls are checked by glm53/serving/front/glm_markup.py (plan_tools,
    # thinking_controls, render_messages), which names the offending field
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Any = None
    thinking_budget: int | None = Field(None, ge=0, le=2**31)  # thinking tokens, then the front closes it
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # refused: this server cannot do what they ask (docs/API.md)
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    functions: Any = None
    function_call: Any = None

    @field_validator("audio", "web_search_options", "verbosity")
    @classmethod
    def _cannot_honour(cls, value: Any, info: Any) -> Any:
        if value is not None:
            raise refusal(f"'{info.field_name}' is not supported by this server")
        return value

    @field_validator("functions", "function_call")
    @classmethod
    def _legacy_tools(cls, value: Any, info: Any) -> Any:
        if value is not None:  # they would change the reply; the current form is served
            raise refusal(f"'{info.field_name}' is the deprecated form of tool calling; send 'tools' and "
                          "'tool_choice'")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value not in (None, ["text"]):
            raise refusal("'modalities' may only be [\"text\"]: this model writes text")
        return value

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise refusal("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return self

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

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
    logprobs: int | None = Field(None, ge=0, le=5)  # the legacy form: how many alternatives a token
    best_of: int | None = None
    suffix: Any = None
    top_logprobs: Any = None

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise refusal("'best_of' is not supported by this server (send n for several choices)")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: Any) -> Any:
        if value:
            raise refusal("'suffix' is not supported by this server: drop it (completions continue the prompt "
                          "at its end; no insertion)")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _legacy_logprobs(cls, value: Any) -> Any:
        if value is not None:
            raise refusal("'top_logprobs' is a chat field; /v1/completions takes 'logprobs': an integer")
        return value

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

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
    return validated(raw, model)


Model = TypeVar("Model", bound=BaseModel)


def validated(raw: bytes, model: type[Model]) -> Model:
    """A JSON object body validated as `model`; raises ApiError 400 naming what is wrong."""
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
