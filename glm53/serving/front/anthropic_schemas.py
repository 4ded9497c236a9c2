"""The request body of Anthropic's Messages API (POST /v1/messages), and its translation into the chat
request the OpenAI route serves, so that both APIs share one generation path.

Scalars are checked by pydantic, strictly (a number is not a string); the content blocks, tools,
tool_choice and thinking by hand, each refusal naming its field (`messages[1].content[0].tool_use_id`).
Fields this front does not know are refused, not ignored: each could change the reply. Accepted and
ignored because they cannot change the reply: `metadata`, `service_tier`, `cache_control` on blocks
and tools (the prefix cache reuses every prompt prefix by itself).

Translation (the decisions are in docs/decisions/chat-markup.md):
- `system` (a string, or text blocks: one system turn each) -> system messages first.
- user text blocks -> a user message; `tool_result` blocks -> `tool` messages (is_error: the text
  prefixed "Error: ", since GLM's observation turn has no error flag); images and documents refused.
- assistant `thinking` blocks -> reasoning_content, text -> content, `tool_use` -> tool_calls (input as
  the arguments). A final assistant message (a prefill to continue) is refused: GLM's template closes
  every assistant turn.
- tools (`input_schema`) -> function tools; tool_choice auto/any/tool/none -> auto/required/named/none;
  `disable_parallel_tool_use` -> parallel_tool_calls false.
- thinking enabled (`budget_tokens`) -> enable_thinking and thinking_budget; disabled or absent ->
  thinking off (Anthropic's default); adaptive -> thinking on, no budget. `display` "summarized" is the
  full reasoning here; "omitted" is refused. `output_config.effort` -> reasoning_effort (GLM-5.3's
  rungs, glm_markup.EFFORT_RUNGS). `output_config.format` (json_schema) -> response_format json_schema
  (thinking must be off: glm53/serving/front/combos.py).
- stop_sequences -> stop (the same limits); the matched string comes back as `stop_sequence`.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from glm53.serving.front.errors import ApiError, bad_request
from glm53.serving.front.schemas import MAX_STOP_CHARS, MAX_STOPS, ChatCompletionRequest, validated, validation_error

ERROR_PREFIX = "Error: "  # a tool_result with is_error: true


class MessagesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str
    max_tokens: int = Field(ge=1, le=2**31)
    messages: list[Any] = Field(min_length=1)
    system: Any = None  # a string or a list of text blocks (_system)
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0, le=2**31)
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Any = None
    output_config: dict[str, Any] | None = None  # effort -> GLM-5.3's reasoning effort; format -> response_format
    metadata: dict[str, Any] | None = None  # user_id: no effect on the reply
    service_tier: str | None = None  # one tier here
    cache_control: dict[str, Any] | None = None  # the prefix cache reuses every prefix by itself


def parse_messages(raw: bytes) -> tuple[MessagesRequest, ChatCompletionRequest]:
    """Validate a /v1/messages body and translate it; raises ApiError 400 naming the field."""
    request = validated(raw, MessagesRequest)
    chat = to_chat(request)
    try:
        return request, ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # the translation's own fields: named as the chat request names them
        raise validation_error(exc) from None


def to_chat(request: MessagesRequest) -> dict[str, Any]:
    """The chat completion body that asks for the same reply."""
    chat: dict[str, Any] = {"model": request.model, "max_tokens": request.max_tokens,
                            "messages": _system(request.system) + _messages(request.messages),
                            "stream": bool(request.stream)}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            chat[name] = getattr(request, name)
    if request.tools is not None:
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(request.tools)]
    if request.tool_choice is not None:
        chat["tool_choice"], parallel = _tool_choice(request.tool_choice)
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    enabled, budget = _thinking(request.thinking, request.max_tokens)
    chat["chat_template_kwargs"] = {"enable_thinking": enabled}
    if budget is not None:
        chat["thinking_budget"] = budget
    effort = _effort(request.output_config)
    if effort is not None:
        if not enabled:
            raise bad_request("'output_config.effort' sets how much the model thinks: enable thinking with "
                              "'thinking' (enabled or adaptive) too", "output_config.effort")
        chat["reasoning_effort"] = effort
    fmt = _format(request.output_config)
    if fmt is not None:
        chat["response_format"] = fmt
    if request.stop_sequences:
        chat["stop"] = _stop_sequences(request.stop_sequences)
    return chat


def _stop_sequences(stops: list[str]) -> list[str]:
    if len(stops) > MAX_STOPS:
        raise bad_request(f"'stop_sequences' has {len(stops)} strings; at most {MAX_STOPS}", "stop_sequences")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"'stop_sequences' strings must have 1 to {MAX_STOP_CHARS} characters", "stop_sequences")
    return stops


def _format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    raw = (config or {}).get("format")
    if raw is None:
        return None
    fmt = _object(raw, "output_config.format")
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict) or set(fmt) - {"type", "schema"}:
        raise bad_request("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                          "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _effort(config: dict[str, Any] | None) -> str | None:
    if config is None:
        return None
    unknown = sorted(set(config) - {"effort", "format"})
    if unknown:
        raise bad_request(f"'output_config.{unknown[0]}' is not supported by this server", f"output_config.{unknown[0]}")
    effort = config.get("effort")
    if effort is not None and effort not in ("low", "medium", "high", "xhigh", "max"):
        raise bad_request(f"'output_config.effort' must be low, medium, high, xhigh or max; got {effort!r}",
                          "output_config.effort")
    return effort


# ---- blocks ----------------------------------------------------------------------------------------

def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"'{where}' must be an object", where)
    return value


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad_request(f"'{where}.{key}' must be a string", f"{where}.{key}")
    return value


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A message's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or a list of content blocks", where)
    return [_object(b, f"{where}[{j}]") for j, b in enumerate(content)]


def _text_only(content: Any, where: str) -> str:
    """Text blocks (or a string) joined; anything else refused."""
    parts = []
    for j, block in enumerate(_blocks(content, where)):
        if block.get("type") != "text":
            raise bad_request(f"'{where}[{j}]' must be a text block ({{\"type\": \"text\", \"text\": ...}}); "
                              "this model reads text only", f"{where}[{j}]")
        parts.append(_string(block, "text", f"{where}[{j}]"))
    return "".join(parts)


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if not isinstance(system, list):
        raise bad_request("'system' must be a string or a list of text blocks", "system")
    return [{"role": "system", "content": _text_only([block], f"system[{j}]")} for j, block in enumerate(system)]


def _messages(messages: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(messages):
        where = f"messages[{i}]"
        msg = _object(raw, where)
        role = msg.get("role")
        if role not in ("user", "assistant"):
            raise bad_request(f"'{where}.role' must be user or assistant; got {role!r}", f"{where}.role")
        if "content" not in msg:
            raise bad_request(f"'{where}.content' is required", f"{where}.content")
        extra = sorted(set(msg) - {"role", "content"})
        if extra:
            raise bad_request(f"'{where}.{extra[0]}' is not a field of a message", f"{where}.{extra[0]}")
        blocks = _blocks(msg["content"], f"{where}.content")
        out += _user(blocks, f"{where}.content") if role == "user" else [_assistant(blocks, f"{where}.content")]
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        where = f"messages[{len(messages) - 1}]"
        raise bad_request(f"'{where}' is an assistant message: continuing a prefilled reply is not supported "
                          "(GLM's chat template closes every assistant turn); end with a user message", where)
    return out


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = block.get("type")
        if kind == "text":
            text.append(_string(block, "text", at))
        elif kind == "tool_result":
            if text:  # text before a result: its own user turn, in order
                out.append({"role": "user", "content": "".join(text)})
                text = []
            call_id = _string(block, "tool_use_id", at)
            result = _text_only(block.get("content", ""), f"{at}.content")
            is_error = block.get("is_error", False)
            if not isinstance(is_error, bool):
                raise bad_request(f"'{at}.is_error' must be true or false", f"{at}.is_error")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": ERROR_PREFIX + result if is_error else result})
        else:
            raise bad_request(f"'{at}' is a {kind!r} block; a user message takes text and tool_result blocks "
                              "(this model reads text only)", at)
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = block.get("type")
        if kind == "text":
            text.append(_string(block, "text", at))
        elif kind == "thinking":
            thinking.append(_string(block, "thinking", at))
        elif kind == "tool_use":
            call_id, name = _string(block, "id", at), _string(block, "name", at)
            arguments = block.get("input")
            if not isinstance(arguments, dict):
                raise bad_request(f"'{at}.input' must be an object", f"{at}.input")
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        else:
            raise bad_request(f"'{at}' is a {kind!r} block; an assistant message takes text, thinking and "
                              "tool_use blocks", at)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


# ---- tools and thinking ----------------------------------------------------------------------------

def _tool(raw: Any, where: str) -> dict[str, Any]:
    tool = _object(raw, where)
    if tool.get("type", "custom") != "custom":
        raise bad_request(f"'{where}.type' {tool.get('type')!r}: server tools are not served here; define the "
                          "tool with name, description and input_schema", f"{where}.type")
    name = _string(tool, "name", where)
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise bad_request(f"'{where}.input_schema' must be a JSON schema object", f"{where}.input_schema")
    function: dict[str, Any] = {"name": name, "parameters": schema}
    if tool.get("description") is not None:
        function["description"] = _string(tool, "description", where)
    return {"type": "function", "function": function}


def _tool_choice(raw: Any) -> tuple[Any, bool | None]:
    """OpenAI's tool_choice for Anthropic's, and parallel_tool_calls (None: not said)."""
    choice = _object(raw, "tool_choice")
    kind = choice.get("type")
    parallel = None
    if "disable_parallel_tool_use" in choice:
        flag = choice["disable_parallel_tool_use"]
        if not isinstance(flag, bool):
            raise bad_request("'tool_choice.disable_parallel_tool_use' must be true or false",
                              "tool_choice.disable_parallel_tool_use")
        parallel = not flag
    if kind == "tool":
        return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}, parallel
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)  # type: ignore[arg-type]
    if mapped is None:
        raise bad_request(f"'tool_choice.type' must be auto, any, tool or none; got {kind!r}", "tool_choice.type")
    return mapped, parallel


def _thinking(raw: Any, max_tokens: int) -> tuple[bool, int | None]:
    """(thinking on, its budget in tokens or None)."""
    if raw is None:
        return False, None
    thinking = _object(raw, "thinking")
    kind = thinking.get("type")
    display = thinking.get("display")
    if display not in (None, "summarized"):
        raise bad_request(f"'thinking.display' {display!r} is not supported here: the reasoning is sent whole "
                          "(summarized or unset)", "thinking.display")
    if kind == "disabled":
        return False, None
    if kind == "adaptive":
        return True, None
    if kind != "enabled":
        raise bad_request(f"'thinking.type' must be enabled, disabled or adaptive; got {kind!r}", "thinking.type")
    budget = thinking.get("budget_tokens")
    if type(budget) is not int or budget < 1:
        raise bad_request("'thinking.budget_tokens' must be an integer >= 1", "thinking.budget_tokens")
    if budget >= max_tokens:
        raise bad_request(f"'thinking.budget_tokens' ({budget}) must be less than max_tokens ({max_tokens})",
                          "thinking.budget_tokens")
    return True, budget


def chat_error(exc: ApiError) -> ApiError:
    """A refusal of the translated chat request, with the field named as this API names it."""
    names = {"chat_template_kwargs.enable_thinking": "thinking", "thinking_budget": "thinking.budget_tokens",
             "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
             "tool_choice.function.name": "tool_choice.name", "response_format": "output_config.format",
             "stop": "stop_sequences"}
    param = names.get(exc.param or "", exc.param)
    if param == exc.param:
        return exc
    message = exc.message.replace(f"'{exc.param}'", f"'{param}'")
    return ApiError(exc.status, message, param, exc.code, exc.headers, exc.kind)
