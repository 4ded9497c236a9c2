"""OpenAI request bodies -> validated generation requests. Every refusal names the field."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class RequestError(ValueError):
    """A bad request: HTTP 400 with this message; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed")
# Fields clients commonly send that this front accepts and that do not change the output.
IGNORED_FIELDS = {"user", "logprobs", "top_logprobs", "parallel_tool_calls", "metadata", "store",
                  "frequency_penalty", "presence_penalty", "repetition_penalty", "tool_choice",
                  "response_format", "reasoning_effort", "service_tier", "logit_bias"}


@dataclass
class GenerationRequest:
    kind: str  # "chat" or "completion"
    model: str | None
    messages: list[dict[str, Any]] | None
    prompt: str | list[int] | None
    max_tokens: int | None
    stream: bool
    include_usage: bool
    sampling: dict[str, Any] = field(default_factory=dict)
    tools: list[Any] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def _number(body: dict[str, Any], name: str, lo: float, hi: float, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise RequestError(f"'{name}' must be {kind}, got {value!r}", name)
    if not lo <= value <= hi:
        raise RequestError(f"'{name}' must be in [{lo}, {hi}], got {value!r}", name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"'{name}' must be true or false, got {value!r}", name)
    return value


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RequestError(f"'{where}' must be an object", where)
        role = msg.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"'{where}.role' must be system, user, assistant or tool; got {role!r}", f"{where}.role")
        content = msg.get("content")
        if isinstance(content, list):  # content parts: only text is served
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f"'{where}.content[{j}]' must be a text part "
                                       "({\"type\": \"text\", \"text\": ...}); this model reads text only",
                                       f"{where}.content[{j}]")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and role == "assistant" and msg.get("tool_calls"):
            content = ""
        elif not isinstance(content, str):
            raise RequestError(f"'{where}.content' must be a string or a list of text parts", f"{where}.content")
        out.append({**msg, "content": content})
    return out


def parse(body: Any, kind: str) -> GenerationRequest:
    """Validate a /v1/chat/completions (kind "chat") or /v1/completions (kind "completion") body."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("n") not in (None, 1):
        raise RequestError("'n' must be 1: this front serves one choice per request", "n")
    if body.get("stop") not in (None, [], ""):
        raise RequestError("'stop' is not supported by this front; generation stops at the model's "
                           "end-of-sequence token or max_tokens", "stop")
    if body.get("echo"):
        raise RequestError("'echo' is not supported by this front", "echo")
    max_tokens = _number(body, "max_tokens", 1, 2**31, integer=True)
    max_completion = _number(body, "max_completion_tokens", 1, 2**31, integer=True)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise RequestError("'max_tokens' and 'max_completion_tokens' disagree; send one", "max_completion_tokens")
    sampling: dict[str, Any] = {}
    for name, lo, hi, integer in (("temperature", 0.0, 100.0, False), ("top_p", 0.0, 1.0, False),
                                  ("top_k", -1, 2**31, True), ("min_p", 0.0, 1.0, False),
                                  ("seed", -2**63, 2**64 - 1, True)):
        value = _number(body, name, lo, hi, integer)
        if value is not None:
            sampling[name] = value
    if sampling.get("top_k") == -1:  # vLLM's spelling of "off"
        sampling["top_k"] = 0
    for name in ("draft", "ignore_eos"):
        value = _flag(body, name)
        if value is not None:
            sampling[name] = value
    stream = bool(_flag(body, "stream"))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", "model")
    request = GenerationRequest(kind=kind, model=model, messages=None, prompt=None,
                                max_tokens=max_tokens if max_tokens is not None else max_completion,
                                stream=stream, include_usage=bool(options.get("include_usage")),
                                sampling=sampling)
    if kind == "chat":
        request.messages = _messages(body)
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("'tools' must be a list", "tools")
        request.tools = tools
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RequestError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        request.template_kwargs = kwargs
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("'prompt' is empty", "prompt")
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in prompt):
            pass
        else:
            raise RequestError("'prompt' must be a non-empty string or a list of token ids", "prompt")
        request.prompt = prompt
    return request
