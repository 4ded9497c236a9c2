"""GLM-5's chat markup for the OpenAI front, both ways: OpenAI messages, tools and thinking controls into
what GLM's chat template reads; the model's token ids into OpenAI reasoning, content and tool calls.

GLM's conventions (GLM-4.5 ... GLM-5.3) as this module relies on them, with sources:

- Prompt: `[gMASK]<sop>`, then `<|system|>`, `<|user|>`, `<|assistant|>`, `<|observation|>` turns with
  the text right after the role (GLM-4.5: a newline between). GLM-5.3 first writes `<|system|>Reasoning
  Effort: Low|High|Max` (template argument `reasoning_effort` low/high, anything else Max). Tools are
  one system turn: "# Tools ... within <tools></tools> XML tags:\n<tools>\n", each tool's `function`
  object as JSON on its own line, "</tools>", then the call format. [GLM-5.3(-Flash) chat_template.jinja
  as copied in github.com/sfxnz/GLM-5.3-Flash-NVFP4-vLLM-2x-DGX-Spark and github.com/Alexbob0/
  glm53-flash-vllm-upstream-sm121, rendered with transformers' jinja settings; GLM-4.5-Air's template as
  quoted in ikawrakow/ik_llama.cpp discussion #753]
- Calls the model writes: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`
  back to back (GLM-4.5: newlines after NAME and between tags); V is a string value raw, any other value
  as JSON. [same templates; sglang python/sglang/srt/function_call/glm47_moe_detector.py, "GLM-4.7 and
  GLM-5"; vllm vllm/tool_parsers/glm4_moe_tool_parser.py: string-typed values raw, others JSON]
- History: an assistant turn is `<think>REASONING</think>` (`<think></think>` without reasoning; GLM-5/5.1
  `</think>`), its content stripped, its calls as above from `arguments` mappings. A run of tool results
  is one `<|observation|>` and a `<tool_response>TEXT</tool_response>` each, in the preceding calls'
  order when the ids match one to one. Reasoning stays in history unless `clear_thinking`. [templates]
- Thinking: GLM-5.3's generation prompt is `<|assistant|><think>` with no `enable_thinking` switch
  (GLM-5/5.1: `</think>` when enable_thinking is false; GLM-4.5: the model opens `<think>` itself,
  `\n<think></think>` when off); the reply is "reasoning</think>content". [templates; public GLM-5.3
  deployment notes patching that generation-prompt line to add a switch; GLM-5 measured with
  zai-org/GLM-5's tokenizer: prompt ends `<|assistant|><think>`, history `<|assistant|></think>2`]
- Tokens: GLM-5's added tokens keep GLM-4.5's order, from <|endoftext|> 154820, [MASK], [gMASK] 154822,
  [sMASK], <sop> 154824, <eop>, <|system|> .. <|observation|> 154826-9, the image/video/audio/
  transcription brackets, <|code_prefix|>/<|code_middle|>/<|code_suffix|>, <think> 154841, </think>,
  <tool_call>, </tool_call>, <tool_response>, </tool_response>, <arg_key>, </arg_key>, <arg_value>,
  </arg_value>, to /nothink, box, <|image|>, <|video|>. The thinking and tool markup are single tokens
  marked "special": false, so a decode skipping special tokens keeps them; the model stops at
  <|endoftext|>, <|user|> or <|observation|>. [huggingface/transformers#48658 and GLM-OCR's
  tokenizer_config.json (same list); vllm glm4_moe_tool_parser: "not marked as special tokens"]

Decisions:

- tool_choice "none": tools not rendered, call markup stays text. "required": tools rendered and the
  front appends `<tool_call>` where the answer starts (after `</think>`, or at once when thinking is
  closed); named: that plus the name's tokens, and only that name is accepted. GLM's template has no
  tool_choice wording and vLLM's GLM parser does not do required/named; a forced prefix makes the call
  certain without new prompt text. A named choice still renders every tool, so the prompt prefix (and
  the prefix cache) does not change with tool_choice.
- Argument values by the parameter's schema type: "string" raw (whitespace kept); another known type
  must be JSON (no NaN/Infinity) or the call is malformed; a type list with "string": JSON of another
  listed type, else raw; no usable schema: JSON if it parses, else raw (as the parsers above do).
- A call is held until `</tool_call>` and sent whole (begin, arguments, end): a malformed one (unclosed,
  a key without value, a bad value, a tool not offered, a key twice) becomes content, its original
  text, which a sent begin could not undo. The cost: a long argument arrives at the call's end.
- Whitespace alone between content and a call, or after a call, is a separator: dropped.
- `</think>` with no thinking open is dropped: the template splits history content at `</think>`, so
  the literal would turn the next turn's content into reasoning. `<think>` in content opens reasoning
  (GLM-4.5 opens it itself); a nested `<think>` is dropped.
- Thinking off on GLM-5.3's stock template: `close_thinking` appends `</think>` to the prompt's
  `<think>`, the `<think></think>` GLM writes for a turn without reasoning. reasoning_effort takes the
  lowest GLM-5.3 rung (low < high < max) at or above the level asked (minimal/low -> low, medium/high ->
  high, xhigh/max -> max); "none" turns thinking off; other values are refused.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Protocol, Sequence, Union

THINK, END_THINK = "<think>", "</think>"
TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"
ARG_KEY, END_ARG_KEY = "<arg_key>", "</arg_key>"
ARG_VALUE, END_ARG_VALUE = "<arg_value>", "</arg_value>"
MARKUP = (THINK, END_THINK, TOOL_CALL, END_TOOL_CALL, ARG_KEY, END_ARG_KEY, ARG_VALUE, END_ARG_VALUE)

ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's reasoning_effort -> GLM-5.3's rung (None: thinking off)
EFFORT_RUNGS: dict[str, str | None] = {"none": None, "minimal": "low", "low": "low", "medium": "high",
                                       "high": "high", "xhigh": "max", "max": "max"}
_NAME = re.compile(r"[^\s<>]+")  # a tool name must survive the markup: no whitespace, no tags


class MarkupError(ValueError):
    """Bad request input; `param` names the offending field (e.g. messages[3].tool_calls[0].function.arguments)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class TokenizerLike(Protocol):
    """What the parser needs of a `tokenizers.Tokenizer` (pass ChatText.tokenizer)."""

    def token_to_id(self, token: str) -> int | None: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def encode(self, sequence: str, add_special_tokens: bool = True) -> Any: ...


# ---- messages ------------------------------------------------------------------------------------

def render_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the messages GLM's template reads: text content, developer as system,
    tool-call arguments as mappings, reasoning as `reasoning_content`, tool results in call order."""
    if not isinstance(messages, list) or not messages:
        raise MarkupError("'messages' must be a non-empty list", "messages")
    return _results_in_call_order([_message(m, f"messages[{i}]") for i, m in enumerate(messages)])


def _text(content: Any, where: str, allow_none: bool = False) -> str:
    if isinstance(content, str):
        return content
    if content is None and allow_none:
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise MarkupError(f"'{where}[{j}]' must be a text part ({{\"type\": \"text\", \"text\": ...}}); "
                                  "this model reads text only", f"{where}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise MarkupError(f"'{where}' must be a string or a list of text parts", where)


def _message(msg: Any, where: str) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise MarkupError(f"'{where}' must be an object", where)
    role = msg.get("role")
    if role not in ROLES:
        raise MarkupError(f"'{where}.role' must be one of {', '.join(ROLES)}; got {role!r}", f"{where}.role")
    if role in ("system", "developer", "user"):
        text = _text(msg.get("content"), f"{where}.content")
        return {"role": "user" if role == "user" else "system", "content": text}
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise MarkupError(f"'{where}.tool_call_id' must be the id of the call this result answers",
                              f"{where}.tool_call_id")
        return {"role": "tool", "tool_call_id": call_id, "content": _text(msg.get("content"), f"{where}.content")}
    content = _text(msg.get("content"), f"{where}.content", allow_none=True)
    reasoning = msg.get("reasoning_content", msg.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise MarkupError(f"'{where}.reasoning_content' must be a string", f"{where}.reasoning_content")
    if reasoning is None and END_THINK in content:  # reasoning inline, split as GLM's template splits it
        reasoning = content.split(END_THINK)[0].split(THINK)[-1]
        content = content.split(END_THINK)[-1]
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    calls = msg.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise MarkupError(f"'{where}.tool_calls' must be a list", f"{where}.tool_calls")
        if calls:
            out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    return out


def _call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise MarkupError(f"'{where}' must be a function call ({{\"type\": \"function\", \"function\": ...}})", where)
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise MarkupError(f"'{where}.id' must be a string", f"{where}.id")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise MarkupError(f"'{where}.function' must be an object with name and arguments", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise MarkupError(f"'{where}.function.name' must be a name without spaces or tags, got {name!r}",
                          f"{where}.function.name")
    out: dict[str, Any] = {"type": "function", "function": {"name": name,
                                                             "arguments": _arguments(fn.get("arguments"), where)}}
    if call_id is not None:
        out["id"] = call_id
    return out


def _arguments(value: Any, where: str) -> dict[str, Any]:
    where = f"{where}.function.arguments"
    if isinstance(value, dict):
        return value
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise MarkupError(f"'{where}' is not valid JSON: {exc}", where) from exc
        if isinstance(parsed, dict):
            return parsed
    raise MarkupError(f"'{where}' must be a JSON object (a string holding one)", where)


def _results_in_call_order(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of tool results after an assistant turn with calls, in the calls' order when every
    call and result id is present and unique and each result's id names a call (GLM's template does
    the same; doing it here keeps templates without that logic, like the tiny one, equal)."""
    out = list(messages)
    i = 0
    while i < len(out):
        j = i
        while j < len(out) and out[j]["role"] == "tool":
            j += 1
        if j > i and i > 0 and out[i - 1]["role"] == "assistant":
            ids = [c.get("id") for c in out[i - 1].get("tool_calls", [])]
            results = [m["tool_call_id"] for m in out[i:j]]
            if (ids and None not in ids and len(set(ids)) == len(ids) and len(set(results)) == len(results)
                    and set(results) <= set(ids)):
                out[i:j] = sorted(out[i:j], key=lambda m: ids.index(m["tool_call_id"]))
        i = max(j, i + 1)
    return out


# ---- tools and tool_choice -----------------------------------------------------------------------

@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools and tool_choice are realised: `render` goes to the template as `tools`;
    `schemas` (name -> parameters) are the calls the parser accepts (None: none); `forced_name` and
    `required` say what `forced_call_ids` forces."""

    render: list[dict[str, Any]] | None = None
    schemas: dict[str, Any] | None = None
    required: bool = False
    forced_name: str | None = None


def plan_tools(tools: Any, tool_choice: Any = None) -> ToolPlan:
    normal = _tools(tools)
    names = [t["function"]["name"] for t in normal]
    choice = ("auto" if normal else "none") if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise MarkupError("'tool_choice' must be none, auto, required or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        if name not in names:
            raise MarkupError(f"'tool_choice.function.name' {name!r} is not one of the request's tools",
                              "tool_choice.function.name")
        schemas = {name: normal[names.index(name)]["function"].get("parameters")}
        return ToolPlan(render=normal, schemas=schemas, required=True, forced_name=name)
    if choice not in ("none", "auto", "required"):
        raise MarkupError(f"'tool_choice' must be none, auto, required or a named function; got {choice!r}",
                          "tool_choice")
    if choice == "required" and not normal:
        raise MarkupError("'tool_choice' required needs 'tools'", "tool_choice")
    if choice == "none" or not normal:
        return ToolPlan()
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in normal}
    return ToolPlan(render=normal, schemas=schemas, required=choice == "required")


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Validated tools in one canonical form, {"type", "function": {name, description, parameters}},
    so the same tools render the same prompt whatever order or extra keys a client sends."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise MarkupError("'tools' must be a list", "tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise MarkupError(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise MarkupError(f"'{where}.function.name' must be a name without spaces or tags, got {name!r}",
                              f"{where}.function.name")
        if any(t["function"]["name"] == name for t in out):
            raise MarkupError(f"'{where}.function.name' {name!r} names an earlier tool too", f"{where}.function.name")
        entry: dict[str, Any] = {"name": name}
        if fn.get("description") is not None:
            if not isinstance(fn["description"], str):
                raise MarkupError(f"'{where}.function.description' must be a string", f"{where}.function.description")
            entry["description"] = fn["description"]
        if fn.get("parameters") is not None:
            if not isinstance(fn["parameters"], dict):
                raise MarkupError(f"'{where}.function.parameters' must be a JSON schema object",
                                  f"{where}.function.parameters")
            entry["parameters"] = fn["parameters"]
        out.append({"type": "function", "function": entry})
    return out


def forced_call_ids(plan: ToolPlan, tokenizer: TokenizerLike) -> list[int]:
    """The ids that start the forced call: `<tool_call>`, then the name's tokens for a named choice."""
    if not plan.required:
        return []
    markup = MarkupIds.of(tokenizer)
    if markup.tool_call is None:
        raise ValueError("the tokenizer has no <tool_call> token: tool_choice required/named cannot be forced")
    name = tokenizer.encode(plan.forced_name, add_special_tokens=False).ids if plan.forced_name else []
    return [markup.tool_call, *name]


# ---- thinking ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Thinking:
    enabled: bool
    template_kwargs: dict[str, Any]


def thinking_controls(reasoning_effort: Any = None, template_kwargs: Mapping[str, Any] | None = None) -> Thinking:
    """`reasoning_effort` and chat_template_kwargs' `enable_thinking` -> whether the reply thinks, and
    the template arguments (GLM-5.3's `reasoning_effort` rung; `enable_thinking` when off)."""
    kwargs = dict(template_kwargs or {})
    enable = kwargs.get("enable_thinking")
    if enable is not None and not isinstance(enable, bool):
        raise MarkupError("'chat_template_kwargs.enable_thinking' must be true or false",
                          "chat_template_kwargs.enable_thinking")
    if reasoning_effort is not None:
        if reasoning_effort not in EFFORT_RUNGS:
            raise MarkupError(f"'reasoning_effort' must be one of {', '.join(EFFORT_RUNGS)}; got {reasoning_effort!r}",
                              "reasoning_effort")
        rung = EFFORT_RUNGS[reasoning_effort]
        if enable is True and rung is None or enable is False and rung is not None:
            raise MarkupError(f"'reasoning_effort' {reasoning_effort!r} contradicts "
                              f"chat_template_kwargs.enable_thinking={str(enable).lower()}", "reasoning_effort")
        if rung is None:
            enable = False
        else:
            kwargs["reasoning_effort"] = rung
    enabled = enable is not False
    if not enabled:
        kwargs["enable_thinking"] = False
    return Thinking(enabled, kwargs)


def close_thinking(prompt_ids: Sequence[int], enabled: bool, tokenizer: TokenizerLike) -> list[int]:
    """Ids to append to the prompt so that a reply with thinking off starts after `<think></think>`:
    `</think>` when the template opened thinking anyway (GLM-5.3's has no switch)."""
    end = MarkupIds.of(tokenizer).end_think
    if enabled or end is None or not thinking_open(prompt_ids, tokenizer):
        return []
    return [end]


def thinking_open(prompt_ids: Sequence[int], tokenizer: TokenizerLike) -> bool:
    """Whether the prompt leaves the reply inside a thinking block (it ends with `<think>`): the
    parser's `thinking_started`."""
    think = MarkupIds.of(tokenizer).think
    return bool(prompt_ids) and think is not None and prompt_ids[-1] == think


class Steering:
    """Ids the front appends itself instead of sampling. Push every generated (and appended) id in
    order; `due()` is what to append before the next sampled token. `</think>` when the thinking block
    holds `budget` tokens; the forced call right where the answer starts (after `</think>`, or at once
    when thinking is closed). A front generating in bursts stops at `stop_ids` and caps a burst inside
    thinking at `thinking_left()` so the moment is not missed."""

    def __init__(self, tokenizer: TokenizerLike, thinking_started: bool, budget: int | None = None,
                 forced_call: Sequence[int] = ()) -> None:
        if budget is not None and budget < 0:
            raise ValueError("a thinking budget is a count of tokens, >= 0")
        self._ids = MarkupIds.of(tokenizer)
        self._budget = budget
        self._forced_call = list(forced_call)
        self._open = thinking_started
        self._spent = 0  # the reply's thinking tokens so far
        self._since_close = 0  # tokens since thinking closed (or since the start)
        self._forced = False

    @property
    def stop_ids(self) -> frozenset[int]:
        end = self._ids.end_think
        return frozenset({end}) if self._forced_call and end is not None else frozenset()

    def push(self, ids: Sequence[int]) -> None:
        for t in ids:
            if self._open:
                if t == self._ids.end_think:
                    self._open, self._since_close = False, 0
                else:
                    self._spent += 1
            else:
                if self._forced_call and self._since_close == 0 and t == self._forced_call[0]:
                    self._forced = True
                self._since_close += 1
                if t == self._ids.think:
                    self._open = True

    def thinking_left(self) -> int | None:
        if not self._open or self._budget is None:
            return None
        return max(self._budget - self._spent, 0)

    def due(self) -> list[int]:
        if self._open:
            return [self._ids.end_think] if self.thinking_left() == 0 and self._ids.end_think is not None else []
        if self._forced_call and not self._forced and self._since_close == 0:
            return list(self._forced_call)
        return []


# ---- replies -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MarkupIds:
    """The tokenizer's ids for GLM's thinking and tool markup (None where it has no such token)."""

    think: int | None
    end_think: int | None
    tool_call: int | None
    end_tool_call: int | None
    arg_key: int | None
    end_arg_key: int | None
    arg_value: int | None
    end_arg_value: int | None

    @classmethod
    def of(cls, tokenizer: TokenizerLike) -> "MarkupIds":
        return cls(*(tokenizer.token_to_id(t) for t in MARKUP))

    @property
    def text(self) -> dict[int, str]:
        """id -> the markup's literal text."""
        return {getattr(self, f.name): t for f, t in zip(fields(self), MARKUP) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallBegin:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    text: str  # a piece of the arguments' JSON text; the pieces of one call concatenate to it


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


Event = Union[ReasoningDelta, ContentDelta, ToolCallBegin, ToolCallArguments, ToolCallEnd]


def openai_delta(event: Event) -> dict[str, Any] | None:
    """The `delta` of a chat.completion.chunk for one event (None: nothing to send)."""
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, ToolCallBegin):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    if isinstance(event, ToolCallArguments):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    return None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class Reply:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def of(cls, events: Sequence[Event]) -> "Reply":
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        calls: dict[int, ToolCall] = {}
        for e in events:
            if isinstance(e, ToolCallBegin):
                calls[e.index] = ToolCall(e.id, e.name, "")
            elif isinstance(e, ToolCallArguments):
                calls[e.index].arguments += e.text
        return cls(content or None, reasoning or None, [calls[i] for i in sorted(calls)])

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message (reasoning as `reasoning_content`, as vLLM and SGLang send it)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls]
        return msg

    def finish_reason(self, base: str) -> str:
        """OpenAI's finish_reason: "tool_calls" when the reply called tools and stopped, else `base`."""
        return "tool_calls" if self.tool_calls and base == "stop" else base


class _Text:
    """Incremental decode of a run of text ids: a delta never ends inside a UTF-8 character. The text
    is decoded from the last emitted piece on, so a long run costs no more than a short one."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # context start: the last emitted piece
        self._read = 0  # ids up to here are emitted

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        before = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):  # wait for the rest of a character
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]

    def flush(self) -> str:
        """The rest, a dangling partial character included."""
        before = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(before):] if len(text) > len(before) else ""


class ReplyParser:
    """Streams a reply's token ids into events. `thinking_started`: the prompt opened `<think>` (see
    `thinking_open`). `tools`: name -> parameters schema of the calls to accept (ToolPlan.schemas; None:
    no calls, their markup stays text). Call ids are f"{id_prefix}_{index}": pass something unique per
    request (e.g. "call_" + the request id's hex) for ids unique across a conversation."""

    def __init__(self, tokenizer: TokenizerLike, thinking_started: bool, tools: Mapping[str, Any] | None = None,
                 id_prefix: str = "call") -> None:
        self._tok = tokenizer
        self._ids = MarkupIds.of(tokenizer)
        self._literal = self._ids.text
        self._tools = tools
        self._id_prefix = id_prefix
        self._reasoning = thinking_started
        self._text = _Text(tokenizer)
        self._call: list[int] | None = None  # ids after an open <tool_call>
        self._held = ""  # trailing content whitespace not sent yet
        self._after_call = False  # content whitespace after a call is a separator
        self._calls = 0
        self._events: list[Event] = []

    def push(self, ids: Sequence[int]) -> list[Event]:
        m = self._ids
        for t in ids:
            if self._call is not None:
                if t == m.end_tool_call:
                    self._close_call()
                elif t in (m.tool_call, m.think, m.end_think):
                    self._abandon_call()  # then read t as if no call were open
                    self._markup(t)
                else:
                    self._call.append(t)
            elif t in self._literal:
                self._markup(t)
            else:
                self._emit_text(self._text.push([t]))
        return self._take()

    def finish(self) -> list[Event]:
        if self._call is not None:
            self._abandon_call()
        self._emit_text(self._text.flush())
        if self._held:
            self._events.append(ContentDelta(self._held))
        self._held = ""
        return self._take()

    # markup outside a call
    def _markup(self, t: int) -> None:
        m = self._ids
        self._emit_text(self._text.flush())
        if t == m.think:
            self._reasoning = True  # a nested <think> is dropped
        elif t == m.end_think:
            self._reasoning = False  # with no thinking open, dropped (see the module docstring)
        elif t == m.tool_call and not self._reasoning:
            self._call = []
        else:  # markup out of place: its text
            self._emit_text(self._literal[t])

    def _emit_text(self, text: str) -> None:
        if not text:
            return
        if self._reasoning:
            self._events.append(ReasoningDelta(text))
            return
        text = self._held + text
        if self._after_call:
            text = text.lstrip()
            if not text:
                self._held = ""
                return
            self._after_call = False
        body = text.rstrip()
        self._held = text[len(body):]
        if body:
            self._events.append(ContentDelta(body))

    # tool calls
    def _close_call(self) -> None:
        ids, self._call = self._call or [], None
        parsed = self._parse_call(ids)
        if parsed is None:
            self._emit_text(self._original(ids) + END_TOOL_CALL)
            return
        name, arguments = parsed
        index = self._calls
        self._calls += 1
        self._held, self._after_call = "", True
        self._events += [ToolCallBegin(index, f"{self._id_prefix}_{index}", name),
                         ToolCallArguments(index, json.dumps(arguments, ensure_ascii=False)), ToolCallEnd(index)]

    def _abandon_call(self) -> None:
        ids, self._call = self._call or [], None
        self._emit_text(self._original(ids))

    def _pieces(self, ids: list[int]) -> list[int | str]:
        """The call's ids as markup ids and decoded text runs."""
        out: list[int | str] = []
        run: list[int] = []
        for t in ids + [-1]:
            if t in self._literal or t == -1:
                if run:
                    out.append(self._tok.decode(run))
                    run = []
                if t != -1:
                    out.append(t)
            else:
                run.append(t)
        return out

    def _original(self, ids: list[int]) -> str:
        return TOOL_CALL + "".join(p if isinstance(p, str) else self._literal[p] for p in self._pieces(ids))

    def _parse_call(self, ids: list[int]) -> tuple[str, dict[str, Any]] | None:
        """NAME (<arg_key>K</arg_key> ws <arg_value>V</arg_value> ws)*, or None when malformed."""
        m = self._ids
        pieces = self._pieces(ids)
        i = 0
        name = ""
        while i < len(pieces) and isinstance(pieces[i], str):
            name += pieces[i]
            i += 1
        name = name.strip()
        if self._tools is None or name not in self._tools:
            return None
        schema = self._tools[name]
        arguments: dict[str, Any] = {}

        def text_then(i: int, tag: int | None, blank: bool) -> tuple[str, int] | None:
            """Optional text (whitespace only if `blank`), then `tag`; the text and the index after."""
            text = ""
            if i < len(pieces) and isinstance(pieces[i], str):
                text, i = pieces[i], i + 1
                if blank and text.strip():
                    return None
            if i < len(pieces) and pieces[i] == tag:
                return text, i + 1
            return None

        while i < len(pieces):
            step = text_then(i, m.arg_key, blank=True)
            if step is None:
                return None
            key_step = text_then(step[1], m.end_arg_key, blank=False)
            if key_step is None:
                return None
            key, i = key_step[0].strip(), key_step[1]
            value_open = text_then(i, m.arg_value, blank=True)
            if value_open is None:
                return None
            value_step = text_then(value_open[1], m.end_arg_value, blank=False)
            if value_step is None or not key or key in arguments:
                return None
            ok, value = _typed(value_step[0], _property(schema, key))
            if not ok:
                return None
            arguments[key] = value
            i = value_step[1]
            if i < len(pieces) and isinstance(pieces[i], str):
                if pieces[i].strip():
                    return None
                i += 1
        return name, arguments

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        merged: list[Event] = []
        for e in events:  # one delta per kind and push
            if merged and type(e) is type(merged[-1]) and isinstance(e, (ContentDelta, ReasoningDelta)):
                merged[-1] = type(e)(merged[-1].text + e.text)
            else:
                merged.append(e)
        return merged


def parse_reply(tokenizer: TokenizerLike, ids: Sequence[int], thinking_started: bool,
                tools: Mapping[str, Any] | None = None, id_prefix: str = "call") -> Reply:
    """A finished reply: the same events as streaming it, joined."""
    parser = ReplyParser(tokenizer, thinking_started, tools, id_prefix)
    return Reply.of(parser.push(ids) + parser.finish())


def _property(parameters: Any, key: str) -> Any:
    if isinstance(parameters, dict) and isinstance(parameters.get("properties"), dict):
        return parameters["properties"].get(key)
    return None


def _schema_types(schema: Any) -> set[str] | None:
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind):
        return set(kind)
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return {"string"}
    return None


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _typed(raw: str, schema: Any) -> tuple[bool, Any]:
    """An <arg_value>'s text as a JSON value, by the parameter's schema type (module docstring)."""
    types = _schema_types(schema)
    if types == {"string"}:
        return True, raw
    try:
        value = json.loads(raw.strip(), parse_constant=_refuse_constant)
    except ValueError:
        return (types is None or "string" in types), raw
    if types is None or "string" not in types:
        return True, value
    kind = _json_kind(value)
    wanted = types - {"string"}
    return True, value if kind in wanted or kind == "integer" and "number" in wanted else raw
