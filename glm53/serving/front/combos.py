"""Rules between chat fields that are each fine alone (docs/API.md, "Fields together").

- response_format json_object / json_schema turns thinking off: GLM-5.3's template opens the reply
  inside `<think>` and the grammar constrains from the first token, so the JSON would land in the
  thinking block. A request that explicitly asks for thinking as well is refused (400 naming
  response_format).
- A steered reply (thinking_budget, a forced tool call, parallel_tool_calls false) runs as several
  engine calls (glm53/serving/front/steer.py) and the logits policy lives for one call. Presence and frequency
  penalties hold across them: the sampling's `reply_start` (glm53/serving/front/service.py) makes each call count
  the reply's tokens its prompt already holds. A grammar cannot: it would restart at each call and
  cannot hold the ids the front appends; nor can logprobs: those ids have no model log-probability.
  Those two are refused with steering.
"""
from __future__ import annotations

from typing import Any

from glm53.serving.front.errors import bad_request
from glm53.serving.front.schemas import ChatCompletionRequest


def wants_json(request: ChatCompletionRequest) -> bool:
    return request.response_format is not None and request.response_format.type != "text"


def asked_thinking(request: ChatCompletionRequest) -> str | None:
    """The field by which the client explicitly asked for thinking, or None."""
    if (request.chat_template_kwargs or {}).get("enable_thinking") is True:
        return "chat_template_kwargs.enable_thinking"
    if request.reasoning_effort not in (None, "none"):
        return "reasoning_effort"
    if request.thinking_budget is not None:
        return "thinking_budget"
    return None


def template_kwargs(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """chat_template_kwargs as the template gets them: thinking off under a JSON response_format."""
    if not wants_json(request):
        return request.chat_template_kwargs
    asked = asked_thinking(request)
    if asked is not None:
        raise bad_request(f"'response_format' {request.response_format.type!r} cannot be combined with thinking "
                          f"('{asked}'): the reply would start inside the thinking block", "response_format")
    return {**(request.chat_template_kwargs or {}), "enable_thinking": False}


STEERING = "thinking_budget, a forced tool_choice or parallel_tool_calls false"


def check_steered(request: ChatCompletionRequest) -> None:
    """Refuse the fields a steered (burst-by-burst) reply cannot keep exact."""
    if wants_json(request):
        raise bad_request(f"'response_format' cannot be combined with {STEERING}: the grammar would restart at "
                          "each burst and cannot hold the ids the server appends", "response_format")
    if request.logprobs:
        raise bad_request(f"'logprobs' cannot be combined with {STEERING}: the ids the server appends have no "
                          "log-probability", "logprobs")
